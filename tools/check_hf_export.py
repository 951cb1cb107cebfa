"""Checks a `braid train` Hugging Face export against transformers: loads <run>/hf/llm with
AutoModelForCausalLM and <run>/hf/vision with SiglipVisionModel, runs the same random inputs
through them and through `braid forward`, and prints the largest logit / hidden-state difference;
loads <run>/hf/audio with WhisperModel (encoder weights only; the decoder is reported missing).

    /work/venv/bin/python tools/check_hf_export.py runs/demo/hf   # from the repository root, after a release build

Needs torch, transformers, safetensors.
"""
import torch, numpy as np, subprocess, json, sys
from safetensors.torch import save_file, load_file
from transformers import AutoModelForCausalLM, SiglipVisionModel, WhisperModel
d = sys.argv[1]
torch.manual_seed(0)
ids = torch.randint(0, 261, (1, 40))
m = AutoModelForCausalLM.from_pretrained(d + "/llm", torch_dtype=torch.float32).eval()
with torch.no_grad():
    ref = m(input_ids=ids).logits[0]
save_file({"input_ids": ids.to(torch.int64)}, "/tmp/in_ids.safetensors")
subprocess.run(["target/release/braid", "forward", "--model", d + "/llm", "--input", "/tmp/in_ids.safetensors", "--output", "/tmp/out_ids.safetensors"], check=True)
ours = load_file("/tmp/out_ids.safetensors")["logits"].reshape(ref.shape)
print("llm logits max abs diff", (ours - ref).abs().max().item(), "scale", ref.abs().max().item())
v = SiglipVisionModel.from_pretrained(d + "/vision").eval()
px = torch.randn(2, 3, 32, 32)
with torch.no_grad():
    vr = v(pixel_values=px).last_hidden_state
save_file({"pixel_values": px}, "/tmp/in_px.safetensors")
subprocess.run(["target/release/braid", "forward", "--model", d + "/vision", "--input", "/tmp/in_px.safetensors", "--output", "/tmp/out_px.safetensors"], check=True)
vo = load_file("/tmp/out_px.safetensors")["last_hidden_state"].reshape(vr.shape)
print("vision max abs diff", (vo - vr).abs().max().item(), "scale", vr.abs().max().item())
a = WhisperModel.from_pretrained(d + "/audio").eval()
print("audio loaded:", type(a).__name__, sum(p.numel() for p in a.encoder.parameters()))
