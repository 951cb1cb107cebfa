// conv.cu: the CUDA kernels of this family (not written yet).
#include "common.cuh"
