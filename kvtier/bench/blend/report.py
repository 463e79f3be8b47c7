"""The blend benchmark's table and figure, from its JSON document alone (so --replot redraws an
earlier run). Results on MuSiQue carry its attribution wherever they are shown."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.bench.report import markdown_rows, pyplot, save_figure

HEAD = ("row", "computed share", "first token = full (95% CI)", "KL(full ‖ row) mean (95% CI)",
        "leading tokens = full", "F1 vs full", "F1 vs gold", "TTFT memory, ms (ideal)", "TTFT cold disk, ms (ideal)")
FAMILIES = ("full", "prefix", "naive", "legolink", "cacheblend")


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _ms(v: float | None, ideal: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ({ideal * 1000:.0f})" if ideal is not None else f"{v * 1000:.0f}"


def _cells(r: dict) -> list[str]:
    lo, hi = r["first_token_ci"]
    klo, khi = r["kl_ci"]
    disk = r.get("disk") or {}
    return [r["row"], _num(r["recomputed_share"]), f"{r['first_token_agreement']:.2f} [{lo:.2f}, {hi:.2f}] (n={r['n']})",
            f"{r['kl_mean']:.4g} [{klo:.3g}, {khi:.3g}]", _num(r["leading_equal"], ".1f"), _num(r["f1_full"], ".2f"),
            _num(r["f1_gold"], ".2f"), _ms(r["ttft_s"], r["ideal_s"]), _ms(disk.get("ttft_s"), disk.get("ideal_s"))]


def table(doc: dict) -> str:
    """The markdown table, then how it was measured and the data's attribution."""
    lines = markdown_rows(HEAD, [_cells(r) for r in doc["rows"]])
    s, rates = doc["settings"], doc["rates"]
    disk_bw = rates.get("disk_bandwidth")
    lines += ["", f"{len(doc['questions'])} questions ({'random ids' if s['synthetic'] else 'MuSiQue'}), "
              f"{doc['model']} {doc['dtype']}, greedy {s['max_tokens']} tokens; TTFT medians; prefix and cold-disk rows "
              f"on the first {s['speed_n']} questions. Ideal: {rates['source']}: matmul "
              f"{rates['flops'] / 1e9:.0f} GFLOP/s, memory {rates['memory_bandwidth'] / 1e9:.1f} GB/s"
              + (f", disk {disk_bw / 1e6:.0f} MB/s." if disk_bw else ".")]
    if doc.get("data"):
        lines.append(f"Data: {doc['data']['attribution']}.")
    return "\n".join(lines)


def _family(rows: Sequence[dict], family: str) -> list[dict]:
    return sorted((r for r in rows if r["mode"] == family), key=lambda r: r["recomputed_share"])


def _fidelity(ax, rows: Sequence[dict], key: str, label: str) -> None:
    """`key` against the computed share, one line per method family (agreement with its interval)."""
    for family, marker in zip(FAMILIES, "osv^D"):
        rs = _family(rows, family)
        if not rs:
            continue
        xs, ys = [r["recomputed_share"] for r in rs], [r[key] for r in rs]
        if key == "first_token_agreement":
            # clamped: a Wilson bound at 0 or 1 may round a hair past the point
            err = [[max(0.0, y - r["first_token_ci"][0]) for y, r in zip(ys, rs)],
                   [max(0.0, r["first_token_ci"][1] - y) for y, r in zip(ys, rs)]]
            ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, label=family)
        else:
            ax.plot(xs, ys, marker=marker, label=family)
    ax.set_xscale("log")
    ax.set_xlabel("share of the prompt computed")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def _ttft(ax, rows: Sequence[dict]) -> None:
    """Median TTFT per row from memory, and from a cold disk where timed; ideals as ticks."""
    names = [r["row"] for r in rows]
    xs = range(len(rows))
    mem = [r["ttft_s"] for r in rows]
    disk = [(r.get("disk") or {}).get("ttft_s") or 0.0 for r in rows]
    ax.bar([x - 0.2 for x in xs], mem, width=0.4, label="memory store")
    ax.bar([x + 0.2 for x in xs], disk, width=0.4, label="cold disk")
    ax.scatter([x - 0.2 for x in xs], [r["ideal_s"] for r in rows], marker="_", s=200, color="k", label="ideal (roofline)")
    ax.scatter([x + 0.2 for x in xs if disk[x]], [(rows[x]["disk"] or {})["ideal_s"] for x in xs if disk[x]],
               marker="_", s=200, color="k")
    ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("TTFT, s (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)


def plot(doc: dict, path: str) -> None:
    """Fidelity (KL, first-token agreement) against the share computed per method, and TTFT bars."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    rows = doc["rows"]
    _fidelity(axes[0], rows, "kl_mean", "mean KL(full ‖ row), first token")
    axes[0].set_yscale("symlog", linthresh=1e-3)  # KL is exactly 0 where every token is recomputed
    axes[0].set_ylim(bottom=0)
    _fidelity(axes[1], rows, "first_token_agreement", "first token = full's (Wilson 95%)")
    axes[1].legend(fontsize=8)
    _ttft(axes[2], rows)
    what = "random ids" if doc["settings"]["synthetic"] else "MuSiQue"
    fig.suptitle(f"Blended restores, {doc['model']} {doc['dtype']}, {len(doc['questions'])} questions ({what})")
    if doc.get("data"):
        fig.text(0.01, 0.01, f"Data: {doc['data']['attribution']}.", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, dpi=120)
