"""summary.md of benchmarks/gpu_check.py: one Markdown table per part, from the part files present in OUT."""

from __future__ import annotations

import json
from pathlib import Path


def _f(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _load(out: Path, name: str):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None


def titan_section(t: dict) -> list[str]:
    lines = [f"## titan ({t['device']})", "",
             f"{t.get('peak_dtype', 'bfloat16')} matmul peak measured in this run: {t['measured_peak_tflops']:.4g} "
             "TFLOP/s (best over sizes "
             f"{', '.join(str(n) for n in t['matmul_peak_tflops'])}); device table peak: "
             f"{_f(t['table_peak_tflops'], '.0f')} TFLOP/s.", "",
             "| recipe | tokens/s | MFU % (table peak) | MFU % (measured peak) | peak memory GiB | loss @ last "
             "| speedup |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in t["recipes"]:
        if not r.get("ok"):
            lines.append(f"| {r['recipe']} | failed: {r.get('error', '?').replace('|', '/')} | | | | | |")
            continue
        lines.append(f"| {r['recipe']} | {_f(r['tps'], ',.0f')} | {_f(r['mfu'], '.1f')} | "
                     f"{_f(r['mfu_of_measured_peak'], '.1f')} | {_f(r['memory_gib'], '.2f')} | "
                     f"{_f(r['final_loss'], '.4f')} | {_f(r['speedup'], '.2f')}x |")
    if not t["recipes"]:
        lines.append("| (titan.compare wrote no table: see log.txt) | | | | | | |")
    ck, prof = t["checkpoint"], t["profile"]
    files = ", ".join(f"{k}: {v}" for k, v in prof["files"].items())
    lines += ["", f"Profiled run (exit {prof['exit_code']}): {files}.",
              f"DCP save (exit {ck['exit_code']}): a sync save blocks {_f(ck.get('full_save_s'), '.3f')} s, an async "
              f"one {_f(ck.get('blocked_per_save_s_async'), '.3f')} s (ratio "
              f"{_f(ck.get('blocked_async_vs_sync'), '.2f')}), state {_f(ck.get('state_mib'), ',.0f')} MiB.", ""]
    return lines


def lcsm_section(lc: dict) -> list[str]:
    lines = [f"## lcsm ({lc['device']})", "", f"Paper: {lc['paper']['source']}.", "",
             "| part | L | fastest flash | its time s | vs lazy | vs eager | max abs err (all methods) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in lc["speedups"]:
        lines.append(f"| {r['part']} | {r['seq_len']} | {r['best_flash']} | {r['flash_s']:.3f} | "
                     f"{_f(r['vs_lazy'], '.1f')}x | {_f(r['vs_eager'], '.1f')}x | {r['max_abs_err']:.1e} |")
    return [*lines, ""]


def morphens_section(m: dict) -> list[str]:
    lines = [f"## morphens (exit {m['exit_code']}; trains on {m['device']}, {m['threads']} CPU threads)", "",
             "| method | K | wall s | train cost GFLOP | ensemble acc % | independent / this: FLOPs, wall |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in m["results"] or []:
        s = r.get("speedup")
        ratios = f"{_f(s['cost'], '.2f')}x, {_f(s['wall'], '.2f')}x" if s else ""
        lines.append(f"| {r['method']} | {r['ensemble_size']} | {r['wall_s']:.1f} | {r['train_cost'] / 1e9:,.1f} | "
                     f"{r['ensemble_acc']:.1f} | {ratios} |")
    return [*lines, ""]


def tests_section(text: str) -> list[str]:
    lines = text.strip().splitlines()
    return ["## tests (benchmarks/gpu_numerics.py)", "", f"{lines[0]}: {lines[-1] if len(lines) > 1 else ''}", ""]


def write_summary(out: Path, device: str, load: tuple[float, ...]) -> str:
    lines = [f"# gpu_check on {device}", "", f"Load average at the end: {' '.join(f'{x:.2f}' for x in load)}.", ""]
    for name, section in (("titan.json", titan_section), ("lcsm.json", lcsm_section),
                          ("morphens.json", morphens_section)):
        data = _load(out, name)
        if data is not None:
            lines += section(data)
    if (out / "tests.txt").is_file():
        lines += tests_section((out / "tests.txt").read_text())
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    return text
