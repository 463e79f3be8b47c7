"""`kvtier bench restore`'s tables and figure: the markdown report, the terminal table, the TTFT plot."""

from __future__ import annotations

from kvtier.bench.report import pyplot, save_figure
from kvtier.bench.report import rich_table as table
from kvtier.bench.restore.goals import KVTIER, cells
from kvtier.bench.restore.methods import METHODS


def num(x, nd=3) -> str:
    """A time (or ratio) in a table cell: '-' where not measured."""
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rows: list[dict], goals: list[dict]) -> str:
    lines = ["Bandwidths marked `(emulated)` are limits imposed by the store's read throttle on top of the real "
             "device; `none` is the real tier. Times are medians in seconds. `bytes_read` is in MB (storage dtype).",
             ""]
    # pivot: one line per cell, TTFT per method
    cells_ = cells(rows)
    cols = [m for m in METHODS + ("hf_torch_save",) if any(m in c for c in cells_.values())]
    lines.append("| model | storage | context | tier | bandwidth | " + " | ".join(cols) + " | hf_recompute | best |")
    lines.append("|" + "---|" * (len(cols) + 7))
    hfr = {(r["model"], r["dtype"], r["context_tokens"]): r for r in rows if r["method"] == "hf_recompute"}
    for k, m in cells_.items():
        model, dtype, storage, ctx, tier, bw = k
        best = min((n for n in KVTIER if n in m), key=lambda n: m[n]["ttft_s"], default="-")
        h = hfr.get((model, dtype, ctx))
        lines.append(f"| {model} ({dtype}) | {storage or dtype} | {ctx} | {tier} | {bw} | "
                     + " | ".join(num(m[c]["ttft_s"]) if c in m else "-" for c in cols)
                     + f" | {num(h['ttft_s']) if h else '-'} | {best} |")
    lines += ["", "Full rows (TTFT, restore time = TTFT minus the new tokens' prefill on a ready cache, ideal bound, "
              "fidelity):", "",
              "| model | storage | ctx | new | tier | bandwidth | method | restore_s | ttft_s | ideal_s | bytes_read MB "
              "| stored B/token | max_logit_diff | greedy | repeats | plan |",
              "|" + "---|" * 16]
    for r in rows:
        lines.append(f"| {r['model']} ({r['dtype']}) | {r['storage'] or r['dtype']} | {r['context_tokens']} | "
                     f"{r['new_tokens']} | {r['tier']} | {r['bandwidth']} | {r['method']} | {num(r['restore_s'])} | "
                     f"{num(r['ttft_s'])} | {num(r['ideal_s'])} | {r['bytes_read'] / 1e6:.1f} | "
                     f"{r['stored_bytes_per_token']} | {r['max_logit_diff']:.2e} | "
                     f"{'yes' if r['greedy_match'] else 'NO'} | {r['repeats']} | {r['plan'] or ''} |")
    lines += ["", "Goals:", ""]
    for g in goals:
        lines.append(f"- **{'met' if g['met'] else 'NOT met'}**: {g['goal']}: {g['summary']}")
        for d in g.get("failing", [])[:12]:
            lines.append(f"  - failing: {d['cell']}{' ' + d['method'] if 'method' in d else ''} ratio {d['ratio']}")
    return "\n".join(lines) + "\n"


RICH_HEAD = ("model", "storage", "ctx", "tier", "bandwidth", "method", "restore_s", "ttft_s", "pred_s", "ideal_s",
             "MB read", "B/token", "copy GB/s", "overlap", "host_s", "logit diff", "greedy")


def _rich_cells(r: dict) -> list[str]:
    copy = r.get("copy_s")
    return [r["model"], r["storage"] or r["dtype"], str(r["context_tokens"]), r["tier"], r["bandwidth"],
            r["method"], num(r["restore_s"]), num(r["ttft_s"]), num(r.get("predicted_s")), num(r["ideal_s"]),
            f"{r['bytes_read'] / 1e6:.1f}", str(r["stored_bytes_per_token"]),
            f"{r['bytes_read'] / copy / 1e9:.1f}" if copy else "-", num(r.get("overlap"), 2), num(r.get("host_s")),
            f"{r['max_logit_diff']:.1e}", "yes" if r["greedy_match"] else "NO"]


def rich_table(rows: list[dict]):
    return table("kvtier restore benchmark (medians; '(emulated)' bandwidths are throttled)", RICH_HEAD,
                 [_rich_cells(r) for r in rows])


STYLES = {"recompute": ("k", "o", "-"), "kv": ("tab:blue", "s", "-"), "hidden": ("tab:orange", "^", "-"),
          "bubblefree": ("tab:green", "D", "-"), "cake": ("tab:red", "v", "-"),
          "auto": ("tab:purple", "*", ":"), "hf_torch_save": ("tab:gray", "x", "--")}


def _xval(bw: str) -> float:
    from kvtier.store.spec import parse_rate

    return 2e9 if bw == "none" else parse_rate(bw.split()[0])


def _panels(rows: list[dict]) -> tuple[dict[tuple, list[dict]], list[tuple]]:
    """Rows per (model, dtype, storage, context, tier) panel, and the panels in plotting order."""
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["tier"] != "-":
            panels.setdefault((r["model"], r["dtype"], r["storage"], r["context_tokens"], r["tier"]), []).append(r)
    keys = sorted(panels, key=lambda k: (k[0], k[2], k[3], ["memory", "disk", "redis"].index(k[4])
                                         if k[4] in ("memory", "disk", "redis") else 9))
    return panels, keys


def _panel(ax, k: tuple, rs: list[dict], hf: float | None) -> None:
    """One panel: TTFT against read bandwidth, one line per method, HF's recompute as a level."""
    for m, (col, mark, ls) in STYLES.items():
        pts = sorted((_xval(r["bandwidth"]), r["ttft_s"]) for r in rs if r["method"] == m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=col, marker=mark, linestyle=ls, label=m,
                    markersize=7 if m == "auto" else 5)
    if hf:
        ax.axhline(hf, color="tab:gray", linestyle=":", label="hf_recompute")
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = sorted({_xval(r["bandwidth"]) for r in rs})
    ax.set_xticks(xs)
    ax.set_xticklabels(["none" if x == 2e9 else f"{x / 1e6:g}MB/s*" for x in xs], fontsize=8)
    ax.minorticks_off()
    ax.set_title(f"{k[0]} {k[2] or k[1]} ctx={k[3]} {k[4]}", fontsize=9)
    ax.set_ylabel("TTFT (s)")
    ax.grid(True, which="both", alpha=0.3)


def plot(rows: list[dict], path: str) -> None:
    panels, keys = _panels(rows)
    if not keys:
        return
    hfr = {(r["model"], r["dtype"], r["context_tokens"]): r["ttft_s"] for r in rows if r["method"] == "hf_recompute"}
    ncol = 3
    nrow = -(-len(keys) // ncol)
    fig, axes = pyplot().subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        _panel(ax, k, panels[k], hfr.get((k[0], k[1], k[3])))
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9)
    fig.text(0.5, 0.005, "read bandwidth (* = emulated limit; 'none' = the real tier, unthrottled)", ha="center")
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    save_figure(fig, path)
