"""Raschka's DistilBERT memory figures beside what bench/numerics/memory.py models for the same training step.

    python -m bench.tools.raschka_memory [--out results/tables/raschka_memory]     (make raschka-memory)

Raschka measured DistilBERT fine-tuning on an A100 (batch 12, length 512, Adam) per precision setting with
torch.cuda.max_memory_reserved(). Memory does not depend on the weights, so this builds distilbert-base-uncased's
architecture (transformers' DistilBertConfig defaults) with random weights, runs one training step at that
shape on this CPU per setting, counts it with bench.numerics.memory.StepMemory, and writes the modelled totals and
their ratios to 32-true beside the published ones (`vs_published.md`/`.csv`, labelled "modelled on CPU").
16-mixed is emulated (native fp16 on a CPU is orders of magnitude slower); 32-true, bf16-mixed and bf16-true
run natively where the CPU has bf16 units. Attention is transformers' eager implementation, as DistilBERT ran
when Raschka measured (2023; SDPA came to DistilBERT later, and on CPU its math path keeps bf16 attention
matrices in FP32, which would count the CPU kernel, not the format). A GPU adds on top what the model does not
count: the CUDA context, cuBLAS workspace, and the caching allocator's reserved-but-unused blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from bench.numerics.memory import StepMemory
from bench.numerics.precision import Precision
from bench.reporting.table_cells import published_rows, to_markdown

SETTINGS = {"32-true": ("fp32", "true"), "16-mixed": ("fp16", "mixed"), "bf16-mixed": ("bf16", "mixed"),
            "bf16-true": ("bf16", "true")}
SHAPE = {"batch": 12, "length": 512}  # Raschka: batch 12, max length 512 (IMDb reviews mostly reach it)


def step_breakdown(setting: str, config=None, batch: int = SHAPE["batch"], length: int = SHAPE["length"]) -> dict:
    """One Adam training step of DistilBertForSequenceClassification(config) at (batch, length), counted."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    fmt, mode = SETTINGS[setting]
    torch.manual_seed(0)
    config = config or DistilBertConfig(num_labels=2)
    config._attn_implementation = "eager"  # as transformers ran DistilBERT in 2023 (see the module docstring)
    model = DistilBertForSequenceClassification(config)
    precision = Precision.of(fmt, torch.device("cpu"), mode=mode, backend="auto")  # native where this CPU is fast
    model = precision.prepare(model)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, length))
    labels = torch.randint(0, 2, (batch,))
    counting = StepMemory(model, precision)
    with precision.autocast(), counting.saving():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss = F.cross_entropy(logits.float(), labels)
    loss.backward()
    precision.after_backward(model)
    optimizer.step()
    precision.after_step(model, optimizer)
    return counting.finish(optimizer) | {"backend": precision.backend}


def comparison(breakdowns: dict[str, dict]) -> pd.DataFrame:
    published = {r["setting"]: r for r in published_rows()
                 if r["source"] == "raschka2023" and r["setting"] in SETTINGS and "memory_gb" in r}
    base_pub, base_ours = published["32-true"]["memory_gb"], breakdowns["32-true"]["total"]
    rows = []
    for setting, counted in breakdowns.items():
        pub = published[setting]
        rows.append({
            "source": pub["source"], "model": "distilbert (distilbert-base-uncased architecture)",
            "setting": setting, "published memory (GB)": f"{pub['memory_gb']:.2f}",
            "published vs 32-true": f"{pub['memory_gb'] / base_pub:.2f}",
            "modelled on CPU (GB)": f"{counted['total'] / 1e9:.2f}",
            "modelled vs 32-true": f"{counted['total'] / base_ours:.2f}",
            "of which activations (GB)": f"{(counted['activations'] + counted['weight_copies']) / 1e9:.2f}",
            "our backend": counted["backend"],
            "note": "A100, max_memory_reserved" if setting == "32-true" else "",
        })
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.raschka_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/tables/raschka_memory"))
    args = parser.parse_args(argv)
    breakdowns = {}
    for setting in SETTINGS:
        breakdowns[setting] = step_breakdown(setting)
        print(f"{setting}: {json.dumps(breakdowns[setting])}", file=sys.stderr)
    table = comparison(breakdowns)
    args.out.mkdir(parents=True, exist_ok=True)
    notes = [f"One training step of distilbert-base-uncased's architecture (random weights, eager attention) at batch "
             f"{SHAPE['batch']}, length {SHAPE['length']}, Adam, counted by bench/numerics/memory.py on "
             f"{torch.backends.cpu.get_cpu_capability()} CPU (modelled on CPU; 16-mixed emulated). Published: "
             "Raschka 2023, one A100, torch.cuda.max_memory_reserved(), decimal GB. The model counts parameters, "
             "gradients, optimiser state, weight copies and saved activations; a GPU adds the CUDA context, cuBLAS "
             "workspace and reserved-but-unused allocator blocks."]
    (args.out / "vs_published.md").write_text("# Raschka's DistilBERT memory beside the modelled step\n\n"
                                              + to_markdown(table, notes) + "\n")
    table.to_csv(args.out / "vs_published.csv", index=False)
    (args.out / "breakdowns.json").write_text(json.dumps({"shape": SHAPE, "breakdowns": breakdowns}, indent=2))
    print(to_markdown(table, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
