"""Int4 quality of ``fxopt.quantize`` on real models (CPU): perplexity of float, RTN, GPTQ (± act-order) and AWQ.

Models: Gemma-3-270M (group 128) and SmolLM2-135M (group 64), fetched as GGUF files by
``bash /work/shared/data/get_models.sh DIR`` and dequantized to float32 by transformers (needs ``gguf`` and
``accelerate``). Calibration: ``--cal-samples`` windows of 512 tokens from the start of *Emma*; evaluation: 40
windows of 512 tokens of *Pride and Prejudice* (a different novel), BOS first for Gemma, perplexity over the predicted
tokens. Linears are quantized with ``pack=False`` (``nn.Linear`` holding exactly the dequantized packed weights: the
same numbers as the kernels, without the Triton interpreter on CPU); the output head stays in float (default).

Columns: ``gap_closed`` = (PPL_rtn - PPL) / (PPL_rtn - PPL_float); ``layer_err_vs_rtn`` = mean over linears of
``tr(ΔW H ΔWᵀ)`` of the method over that of RTN for the same calibration inputs (H = XᵀX over calibration tokens);
``cal_s`` = wall time of ``fxopt.quantize`` (Dynamo capture included) on the shared 2-core CPU; ``peak_mb`` = peak
resident memory during it above the float model's.

Usage: ``python benchmarks/quant_quality.py --models-dir /tmp/qmodels [--models gemma smollm] [--cal-samples 128]``
"""
from __future__ import annotations

import copy
import gc
import json
import os
import threading
import time

import torch

from common import parse_args, write_results

from fxopt.quant.calibrate import QuantizeReport, quantize

DATA = "/work/shared/data/austen"
MODELS = {
    "gemma": dict(file="gemma-3-270m.gguf", label="Gemma-3-270M", group_size=128, bos=True),
    "smollm": dict(file="smollm2-135m.gguf", label="SmolLM2-135M", group_size=64, bos=False),
}
VARIANTS = [
    ("gptq (defaults)", dict(method="gptq")),
    ("awq (defaults)", dict(method="awq")),
    ("rtn", dict(method="rtn")),
    ("gptq (plain)", dict(method="gptq", act_order=True, float_target=False)),
    ("awq (plain)", dict(method="awq", float_target=False)),
    ("gptq (no act-order)", dict(method="gptq", act_order=False, float_target=False)),
    ("gptq (mse, static groups)", dict(method="gptq", act_order=True, static_groups=True, mse=True,
                                       float_target=False)),
    ("gptq (mse, static groups, float target)", dict(method="gptq", act_order=True, static_groups=True, mse=True,
                                                     float_target=True)),
    ("gptq (mse)", dict(method="gptq", act_order=True, mse=True, float_target=False)),
]


class PeakRSS:
    """Peak resident set size (MiB) of this process while the context is open, sampled every 50 ms."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _rss(self) -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())


def windows(ids: list[int], n: int, length: int, bos) -> list[torch.Tensor]:
    body = length - (1 if bos is not None else 0)
    out = []
    for i in range(n):
        chunk = ids[i * body:(i + 1) * body]
        if len(chunk) < body:
            break
        out.append(torch.tensor(([bos] if bos is not None else []) + chunk)[None])
    return out


@torch.no_grad()
def perplexity(model, wins) -> tuple[float, int]:
    nll, count = 0.0, 0
    for w in wins:
        logits = model(input_ids=w, use_cache=False).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, w[0, 1:], reduction="sum"))
        count += w.shape[1] - 1
        del logits
    return float(torch.exp(torch.tensor(nll / count))), count


def run_model(key, args, rows, out_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(out_dir, exist_ok=True)

    spec = MODELS[key]
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.models_dir, gguf_file=spec["file"])
    base = AutoModelForCausalLM.from_pretrained(args.models_dir, gguf_file=spec["file"], dtype=torch.float32).eval()
    print(f"[{spec['label']}] loaded in {time.perf_counter() - t:.0f}s", flush=True)
    bos = tok.bos_token_id if spec["bos"] else None
    read = lambda name: open(os.path.join(DATA, name), encoding="utf-8").read()  # noqa: E731
    cal_ids = tok(read("emma.txt"), add_special_tokens=False)["input_ids"]
    eval_ids = tok(read("prideprejudice.txt"), add_special_tokens=False)["input_ids"]
    cal = [{"input_ids": w, "use_cache": False} for w in windows(cal_ids, args.cal_samples, 512, bos)]
    ev = windows(eval_ids, args.eval_windows, 512, bos)
    G = args.group_size or spec["group_size"]
    ppl_f, n_tok = perplexity(base, ev)
    print(f"[{spec['label']}] float PPL {ppl_f:.3f} over {n_tok} tokens", flush=True)
    res = {"model": spec["label"], "group": G, "method": "float", "ppl": ppl_f, "eval_tokens": n_tok}
    rows.append(res)
    ppl_rtn = None
    for name, kw in VARIANTS:
        if args.variants and name.split(" ")[0] not in args.variants and name not in args.variants \
                and name != "rtn":
            continue
        model = copy.deepcopy(base)
        gc.collect()
        rep = QuantizeReport()
        try:
            with PeakRSS() as mem:
                t = time.perf_counter()
                quantize(model, cal, group_size=G, pack=False, report=rep, progress=False, **kw)
                cal_s = time.perf_counter() - t
            ppl, _ = perplexity(model, ev)
        except Exception as e:  # noqa: BLE001 - record and go on with the other variants
            rows.append({"model": spec["label"], "group": G, "method": name, "error": f"{type(e).__name__}: {e}"})
            print(f"[{spec['label']}] {name} failed: {e!r}", flush=True)
            continue
        ratios = [r["err_vs_rtn"] for r in rep.rows]
        row = {"model": spec["label"], "group": G, "method": name, "ppl": ppl, "eval_tokens": n_tok,
               "cal_tokens": 0 if kw["method"] == "rtn" else 512 * len(cal), "cal_s": cal_s,
               "peak_mb": mem.peak - mem.base,
               "layer_err_vs_rtn": sum(ratios) / len(ratios) if ratios else None,
               "linears": len(rep.rows) if rep.rows else None}
        if name == "rtn":
            ppl_rtn = ppl
            for r in rows:  # rows measured before RTN (the defaults come first)
                if r.get("model") == spec["label"] and r.get("group") == G and "ppl" in r \
                        and r["method"] not in ("float", "rtn") and ppl_rtn != ppl_f:
                    r["gap_closed"] = (ppl_rtn - r["ppl"]) / (ppl_rtn - ppl_f)
        elif ppl_rtn is not None and ppl_rtn != ppl_f:
            row["gap_closed"] = (ppl_rtn - ppl) / (ppl_rtn - ppl_f)
        rows.append(row)
        print(f"[{spec['label']}] {name}: PPL {ppl:.3f} cal {cal_s:.0f}s peak +{row['peak_mb']:.0f} MiB "
              f"layer err vs rtn {row['layer_err_vs_rtn']}", flush=True)
        with open(os.path.join(out_dir, "quant_quality.partial.json"), "w") as f:
            json.dump(rows, f, indent=1)
        del model
        gc.collect()


def main():
    def extra(p):
        p.add_argument("--models-dir", default="/tmp/qmodels")
        p.add_argument("--models", nargs="*", default=["gemma", "smollm"])
        p.add_argument("--variants", nargs="*", default=None,
                       help="subset of the variants: rtn gptq awq (every variant of that method), or one full name "
                            "such as 'gptq (mse, static groups)'")
        p.add_argument("--cal-samples", type=int, default=128)
        p.add_argument("--group-size", type=int, default=None, help="override the model's group size (64, 128)")
        p.add_argument("--eval-windows", type=int, default=40)

    args = parse_args(__doc__.splitlines()[0], extra)
    torch.manual_seed(0)
    rows: list[dict] = []
    for key in args.models:
        run_model(key, args, rows, args.out)
        write_results("quant_quality", rows, title="Int4 weight quantization quality (fxopt.quantize, CPU)",
                      out_dir=args.out, notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
