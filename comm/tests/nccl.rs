//! `NcclComm`: without NCCL (every CI machine), availability and construction are clean
//! errors naming what is missing; with NCCL and a GPU (`--ignored`, tools/gpu/check.sh), a
//! world of one on `cuda:0` gives SingleRank's results for every collective, and a world
//! whose other rank never joins times out instead of hanging.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use braid_comm::nccl::NcclComm;
use braid_comm::store::{StoreClient, StoreServer};
use braid_comm::{Comm, CommError, SingleRank};
use braid_kernels::{DType, Device, Shape, Tensor};

fn store() -> (StoreServer, StoreClient) {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let client = StoreClient::connect(&server.addr().to_string(), Duration::from_secs(10)).unwrap();
    (server, client)
}

#[test]
fn without_nccl_availability_is_an_error_not_a_panic() {
    match NcclComm::is_available() {
        Ok(v) => eprintln!("NCCL is present here ({v}); nothing to check"),
        Err(e) => {
            assert!(e.contains("not found"), "{e}");
            // Either the driver or NCCL is missing; when NCCL is, the symlink hint is there.
            if e.contains("NCCL") {
                assert!(
                    e.contains("libnccl.so.2") && e.contains("LD_LIBRARY_PATH"),
                    "{e}"
                );
            }
        }
    }
}

#[test]
fn without_nccl_a_world_is_an_error_naming_the_library() {
    if NcclComm::is_available().is_ok() {
        return;
    }
    let (_server, client) = store();
    let e = NcclComm::world(client, 0, 2, Device::Cuda(0), Duration::from_secs(2)).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            CommError::Invalid {
                op: "nccl world",
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("not found"), "{msg}");
    assert!(msg.contains("rank 0 of 2"), "{msg}");
}

// ---- on a GPU with NCCL ----

fn world_of_one() -> NcclComm {
    if let Err(e) = NcclComm::is_available() {
        panic!("NCCL is not available: {e}");
    }
    let (server, client) = store();
    // The store server lives for the whole test process (ids of later subgroups).
    std::mem::forget(server);
    NcclComm::world(client, 0, 1, Device::Cuda(0), Duration::from_secs(60)).unwrap()
}

fn gpu(data: Vec<f32>, dims: &[usize], dtype: DType) -> Tensor {
    let t = Tensor::from_vec(data, dims.to_vec(), Device::Cuda(0)).unwrap();
    braid_kernels::ops::into_dtype(t, dtype).unwrap()
}

fn same(a: &Tensor, b: &Tensor) {
    assert_eq!(a.dims(), b.dims());
    assert_eq!(a.dtype(), b.dtype());
    assert_eq!(a.to_host().unwrap(), b.to_host().unwrap());
}

#[test]
#[ignore = "needs NCCL and a CUDA GPU: tools/gpu/check.sh runs it with --ignored"]
fn world_of_one_matches_single_rank() {
    let c = world_of_one();
    let one = SingleRank;
    assert_eq!((c.rank(), c.size()), (0, 1));
    for dtype in [DType::F32, DType::BF16] {
        let x = gpu(
            (0..12).map(|i| i as f32 * 0.5 - 2.0).collect(),
            &[4, 3],
            dtype,
        );
        let (mut a, mut b) = (x.try_clone().unwrap(), x.try_clone().unwrap());
        c.all_reduce_sum(&mut a).unwrap();
        one.all_reduce_sum(&mut b).unwrap();
        same(&a, &b);
        same(&c.all_gather(&x).unwrap(), &one.all_gather(&x).unwrap());
        same(
            &c.reduce_scatter_sum(&x).unwrap(),
            &one.reduce_scatter_sum(&x).unwrap(),
        );
        let mut a = x.try_clone().unwrap();
        c.broadcast(&mut a, 0).unwrap();
        same(&a, &x);
        let got = c.all_to_all_v(vec![x.try_clone().unwrap()]).unwrap();
        assert_eq!(got.len(), 1);
        same(&got[0], &x);
    }
    // CPU tensors travel through the GPU and come back.
    let mut h = Tensor::from_vec(vec![1.0, 2.0], [2], Device::Cpu).unwrap();
    c.all_reduce_sum(&mut h).unwrap();
    assert_eq!(h.device(), Device::Cpu);
    assert_eq!(h.to_vec_f32().unwrap(), vec![1.0, 2.0]);
    c.barrier().unwrap();
    let sub = c.subgroup(&[0]).unwrap();
    let mut a = gpu(vec![3.0; 4], &[4], DType::F32);
    sub.all_reduce_sum(&mut a).unwrap();
    assert_eq!(a.to_vec_f32().unwrap(), vec![3.0; 4]);
    // Errors, not hangs: no peer in a world of one.
    assert!(c.send(&a, 0).is_err());
    assert!(c.recv(&Shape::new([4]), 0).is_err());
    assert!(c.broadcast(&mut a, 1).is_err());
    let mut u = Tensor::from_vec_u32(vec![1, 2], [2], Device::Cuda(0)).unwrap();
    assert!(c.all_reduce_sum(&mut u).is_err());
}

#[test]
#[ignore = "needs NCCL and a CUDA GPU: tools/gpu/check.sh runs it with --ignored"]
fn a_rank_that_never_joins_times_out() {
    if let Err(e) = NcclComm::is_available() {
        panic!("NCCL is not available: {e}");
    }
    let (_server, client) = store();
    let start = Instant::now();
    let e = NcclComm::world(client, 0, 2, Device::Cuda(0), Duration::from_secs(3)).unwrap_err();
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}
