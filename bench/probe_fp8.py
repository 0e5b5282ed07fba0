"""H200 probe for issue 19's FP8 work: bf16 GEMM vs FP8 row-wise scaled GEMM (torch._scaled_mm, the
dynamic quantization of the activation counted) on the 0.5B and 7B LoRA/full shapes, forward and the
dgrad GEMM; and whether torchao's float8 training converts and steps on this torch. One JSON line per
measurement on stdout.    python3 bench/probe_fp8.py"""

import json
import time

import torch

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max


def rowwise(t):  # per-row amax scale, returns (fp8 tensor, fp32 scale column)
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FMAX
    return (t.float() / scale).to(E4M3), scale


def bench(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def gemm(m, k, n, label):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    wq, ws = rowwise(w)  # frozen base: quantized once
    t_bf = bench(lambda: x @ w.t())

    def fp8():
        xq, xs = rowwise(x)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)

    t_q = bench(fp8)
    xq, xs = rowwise(x)
    t_mm = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16))
    ref = (x @ w.t()).float()
    err = ((fp8().float() - ref).norm() / ref.norm()).item()
    fl = 2 * m * k * n
    print(json.dumps({"shape": label, "m": m, "k": k, "n": n, "bf16_ms": t_bf * 1e3, "fp8_ms_with_quant": t_q * 1e3,
                      "fp8_ms_gemm_only": t_mm * 1e3, "speedup": t_bf / t_q, "bf16_tflops": fl / t_bf / 1e12,
                      "fp8_tflops": fl / t_mm / 1e12, "rel_err": err}), flush=True)  # fmt: skip


def main():
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cap": torch.cuda.get_device_capability()}), flush=True)  # fmt: skip
    for m, k, n, label in [(65536, 896, 4864, "0.5b_mlp_up"), (65536, 4864, 896, "0.5b_mlp_down"),
                           (65536, 896, 896, "0.5b_q"), (16384, 3584, 18944, "7b_mlp_up"),
                           (16384, 18944, 3584, "7b_mlp_down"), (16384, 3584, 3584, "7b_q"),
                           (16384, 3584, 512, "7b_kv")]:  # fmt: skip
        gemm(m, k, n, label)
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        mlp = torch.nn.Sequential(torch.nn.Linear(896, 4864), torch.nn.SiLU(), torch.nn.Linear(4864, 896))
        mlp = mlp.cuda().to(torch.bfloat16)
        convert_to_float8_training(mlp, config=Float8LinearConfig.from_recipe_name("rowwise"))
        x = torch.randn(8192, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        mlp(x).sum().backward()
        print(json.dumps({"torchao": torchao.__version__, "float8_training_rowwise": "ok",
                          "types": sorted({type(m).__name__ for m in mlp.modules()})}), flush=True)  # fmt: skip
    except Exception as e:  # noqa: BLE001 -- a probe: report whatever failed
        print(json.dumps({"torchao_error": repr(e)[:500]}), flush=True)


if __name__ == "__main__":
    main()
