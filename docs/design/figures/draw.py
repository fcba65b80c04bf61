#!/usr/bin/env python3
"""Draw every figure of docs/design/ as SVG, next to this script.

    python docs/design/figures/draw.py            # writes docs/design/figures/*.svg
    python docs/design/figures/draw.py --png DIR  # also PNG previews into DIR

CPU only (matplotlib's SVG backend, no GPU, no cuflash import). The output is byte-identical from
run to run with one matplotlib version: fixed hash salt for the SVG ids, text kept as text (no glyph
paths), no date and a fixed creator in the metadata.

Colours say where data lives: blue = HBM (global memory), green = shared memory, orange = registers.
The numbers drawn (tile sizes, warps) are examples taken from the tile tables in cuflash/plan/; the
tables are the source of truth.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

OUT = Path(__file__).resolve().parent

plt.rcParams.update(
    {
        "svg.hashsalt": "cuflash",
        "svg.fonttype": "none",
        "font.family": "sans-serif",
        "font.sans-serif": ["DejaVu Sans", "Arial", "Helvetica"],
        "font.size": 8,
        "hatch.linewidth": 0.6,
    }
)

KINDS = {
    "hbm": dict(fc="#dbe8f6", ec="#3a6ea5", dark="#9fc0e6", label="HBM (global memory)"),
    "smem": dict(fc="#dcefd8", ec="#4c8c3f", dark="#a9d69e", label="shared memory"),
    "reg": dict(fc="#fde6cc", ec="#c7711c", dark="#f6bf82", label="registers"),
    "plain": dict(fc="#ffffff", ec="#777777", dark="#dddddd", label=""),
    "grey": dict(fc="#eeeeee", ec="#999999", dark="#cccccc", label=""),
}
RED = "#c0392b"
INK = "#222222"

_figures: list[tuple[str, plt.Figure]] = []


# ---------------------------------------------------------------------------------------------
# Helpers: a canvas in units of 0.1 inch, boxes, arrows, labels, legend
# ---------------------------------------------------------------------------------------------


def canvas(name: str, w: float, h: float):
    """A figure of w x h units (1 unit = 0.1 inch) with one axes spanning it, y up."""
    fig = plt.figure(figsize=(w / 10, h / 10))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, w)
    ax.set_ylim(0, h)
    ax.axis("off")
    _figures.append((name, fig))
    return ax


def box(ax, x, y, w, h, kind="plain", text=None, fs=7.5, dark=False, ls="-", lw=0.9, hatch=None, color=None,
        weight="normal", ha="center", tx=None):  # fmt: skip
    k = KINDS[kind]
    fc = color or (k["dark"] if dark else k["fc"])
    ax.add_patch(Rectangle((x, y), w, h, fc=fc, ec=k["ec"], lw=lw, ls=ls, hatch=hatch, zorder=2))
    if text:
        if ha == "center":
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, color=INK, zorder=4,
                    weight=weight, linespacing=1.25)  # fmt: skip
        else:
            ax.text(x + (tx if tx is not None else 0.8), y + h / 2, text, ha="left", va="center", fontsize=fs,
                    color=INK, zorder=4, weight=weight, linespacing=1.25)  # fmt: skip


def label(ax, x, y, text, fs=7.5, ha="center", va="center", color=INK, weight="normal", style="normal", rot=0):
    ax.text(x, y, text, ha=ha, va=va, fontsize=fs, color=color, weight=weight, style=style, rotation=rot, zorder=5,
            linespacing=1.25)  # fmt: skip


def title(ax, x, y, text, fs=10):
    label(ax, x, y, text, fs=fs, ha="left", weight="bold")


def arrow(ax, p, q, text=None, color=INK, ls="-", lw=1.0, rad=0.0, fs=6.8, toff=(0, 0.9), ha="center", style="-|>"):
    ax.annotate("", xy=q, xytext=p, zorder=3,
                arrowprops=dict(arrowstyle=style, color=color, lw=lw, ls=ls, shrinkA=0, shrinkB=0,
                                mutation_scale=9, connectionstyle=f"arc3,rad={rad}"))  # fmt: skip
    if text:
        mx, my = (p[0] + q[0]) / 2 + toff[0], (p[1] + q[1]) / 2 + toff[1]
        label(ax, mx, my, text, fs=fs, ha=ha, color=color)


def cross(ax, x, y, s=1.4, color=RED):
    ax.plot([x - s, x + s], [y - s, y + s], color=color, lw=2, zorder=6, solid_capstyle="round")
    ax.plot([x - s, x + s], [y + s, y - s], color=color, lw=2, zorder=6, solid_capstyle="round")


def hlines(ax, x, y, w, h, n, kind):
    """n - 1 horizontal divider lines inside a box (tiles of a matrix)."""
    for i in range(1, n):
        yy = y + h * i / n
        ax.plot([x, x + w], [yy, yy], color=KINDS[kind]["ec"], lw=0.4, zorder=3)


def vlines(ax, x, y, w, h, n, kind):
    for i in range(1, n):
        xx = x + w * i / n
        ax.plot([xx, xx], [y, y + h], color=KINDS[kind]["ec"], lw=0.4, zorder=3)


def legend(ax, x, y, kinds=("hbm", "smem", "reg"), extra=(), fs=7):
    """A row of coloured squares with labels, from (x, y) rightwards; extra: (patch kwargs, label)."""
    for k in kinds:
        ax.add_patch(Rectangle((x, y - 0.8), 1.6, 1.6, fc=KINDS[k]["fc"], ec=KINDS[k]["ec"], lw=0.9, zorder=2))
        label(ax, x + 2.2, y, KINDS[k]["label"], fs=fs, ha="left")
        x += 3.2 + 0.62 * len(KINDS[k]["label"])
    for kw, text in extra:
        ax.add_patch(Rectangle((x, y - 0.8), 1.6, 1.6, zorder=2, **kw))
        label(ax, x + 2.2, y, text, fs=fs, ha="left")
        x += 3.2 + 0.62 * len(text)


def column_head(ax, x, w, y, text, kind):
    ax.add_patch(Rectangle((x, y - 1.2), w, 2.4, fc=KINDS[kind]["fc"], ec="none", zorder=1))
    label(ax, x + w / 2, y, text, fs=7.5, weight="bold", color=KINDS[kind]["ec"])


def panel(ax, x, y, w, h):
    """A light frame around a group of drawings."""
    ax.add_patch(Rectangle((x, y), w, h, fc="none", ec="#bbbbbb", lw=0.7, zorder=1))


# ---------------------------------------------------------------------------------------------
# 1. Forward data flow (mma.sync kernel)
# ---------------------------------------------------------------------------------------------


def fig_forward():
    ax = canvas("forward.svg", 124, 100)
    title(ax, 2, 97.5, "Forward (flash_fwd.cuh): CTA (m, h, b) computes O and lse of one BLOCK_M-row query tile")

    # Column heads.
    column_head(ax, 2, 20, 92, "HBM", "hbm")
    column_head(ax, 32, 22, 92, "shared memory (per CTA)", "smem")
    column_head(ax, 62, 34, 92, "registers (per warp)", "reg")
    column_head(ax, 104, 18, 92, "HBM", "hbm")

    # HBM inputs: Q, K, V with the tiles this CTA touches.
    box(ax, 4, 70, 14, 18, "hbm")
    hlines(ax, 4, 70, 14, 18, 6, "hbm")
    box(ax, 4, 79, 14, 3, "hbm", dark=True, text="Q tile m", fs=6.8)
    label(ax, 11, 89.2, "Q  (seqlen_q x d)", fs=7)
    box(ax, 4, 47, 14, 18, "hbm")
    hlines(ax, 4, 47, 14, 18, 6, "hbm")
    box(ax, 4, 56, 14, 3, "hbm", dark=True, text="K_j", fs=6.8)
    label(ax, 11, 66.2, "K  (seqlen_k x d)", fs=7)
    box(ax, 4, 24, 14, 18, "hbm")
    hlines(ax, 4, 24, 14, 18, 6, "hbm")
    box(ax, 4, 33, 14, 3, "hbm", dark=True, text="V_j", fs=6.8)
    label(ax, 11, 43.2, "V  (seqlen_k x d)", fs=7)
    label(ax, 11, 21.2, "K/V tiles visited from the last\nvisible block j down to 0", fs=6.3, style="italic")

    # Shared memory.
    box(ax, 34, 77, 18, 5, "smem", text="sQ: Q tile (loaded once)", fs=6.8)
    box(ax, 34, 57, 18, 4, "smem", text="sK stage j % 2: K_j", fs=6.8)
    box(ax, 34, 52.5, 18, 4, "smem", text="sK other stage: K_j-1", fs=6.8, ls="--")
    box(ax, 34, 34, 18, 4, "smem", text="sV stage j % 2: V_j", fs=6.8)
    box(ax, 34, 29.5, 18, 4, "smem", text="sV other stage: V_j-1", fs=6.8, ls="--")
    label(ax, 43, 48.3, "dashed: in flight (cp.async) while\ntile j is used (2-stage tiles)", fs=6.3, style="italic")
    label(ax, 43, 25.5, "rows padded to d + 8 elements:\nldmatrix without bank conflicts", fs=6.3, style="italic")

    # Registers.
    box(ax, 62, 62, 24, 18, "reg",
        text="S = Q K_j^T   (fp32)\nmask: only diagonal /\nragged-end blocks\nP = exp2(S*scale*log2e\n        - m*scale*log2e)", fs=6.8)  # fmt: skip
    box(ax, 88, 62, 8, 18, "reg", text="m, l\nper row\n(running\nmax, sum)", fs=6.5)
    box(ax, 62, 32, 34, 14, "reg",
        text="O accumulator (fp32, unnormalized)\nO = O * exp2((m_old - m_new)*scale*log2e) + P V_j\n(rescaled only when a row max grew)",
        fs=6.6)  # fmt: skip

    # HBM outputs.
    box(ax, 106, 70, 14, 3, "hbm", dark=True, text="lse (fp32)", fs=6.8)
    label(ax, 113, 75, "lse  (seqlen_q per head)", fs=6.5)
    box(ax, 106, 30, 14, 18, "hbm")
    hlines(ax, 106, 30, 14, 18, 6, "hbm")
    box(ax, 106, 39, 14, 3, "hbm", dark=True, text="O tile m", fs=6.8)
    label(ax, 113, 49.2, "O  (seqlen_q x d)", fs=7)

    # Arrows: loads.
    arrow(ax, (18, 80.5), (34, 79.5), "cp.async", toff=(0, 1.2))
    arrow(ax, (18, 57.5), (34, 59), "cp.async", toff=(0, 1.2))
    arrow(ax, (18, 34.5), (34, 36), "cp.async", toff=(0, 1.2))
    # smem -> registers.
    arrow(ax, (52, 79.5), (62, 76), "ldmatrix", toff=(0, 1.6))
    arrow(ax, (52, 59), (62, 66), "ldmatrix", toff=(-1.2, 1.4))
    arrow(ax, (52, 36), (62, 38), "ldmatrix\n.trans", toff=(0, 2.4))
    # P reused from registers.
    arrow(ax, (74, 62), (74, 46), color=KINDS["reg"]["ec"], lw=1.4)
    label(ax, 75, 54, "P packed to 16 bits =\nA operand of P V\n(no shared-memory\nround trip)", fs=6.5, ha="left")
    # Epilogue.
    arrow(ax, (96, 39), (106, 40.5), "O / l,\nonce", toff=(0, 2.6))
    arrow(ax, (96, 72), (106, 71.5), "m*scale\n+ ln l", toff=(0, 2.8), fs=6.3)
    label(ax, 79, 27.5, "epilogue: each warp stages its normalized rows in its own\nsQ rows, then 16-byte coalesced stores; O written once",
          fs=6.3, style="italic")  # fmt: skip

    # S and P never reach HBM.
    ax.plot([86, 99], [79, 86], color=RED, lw=1.1, ls="--", zorder=3)
    cross(ax, 100.5, 86.8)
    label(ax, 113, 84, "S and P never reach\nHBM (nor shared\nmemory)", fs=6.8, color=RED, ha="center", weight="bold")

    # Bottom: the grid and the warp split of one tile.
    panel(ax, 2, 1, 120, 19)
    label(ax, 4, 17.4, "grid = (ceil(seqlen_q / BLOCK_M), nheads, batch)", fs=7.2, ha="left", weight="bold")
    for i in range(6):
        box(ax, 4 + i * 5.2, 8.5, 4.6, 4.6, "grey", text=f"m={5 - i}", fs=6)
        label(ax, 6.3 + i * 5.2, 6.6, f"x={i}", fs=5.8)
    label(ax, 4, 4.2, "causal: blockIdx.x = 0 runs the last (heaviest)\nquery tile, so long CTAs start first", fs=6.3,
          ha="left", style="italic")  # fmt: skip

    label(ax, 40, 17.4, "one CTA, head dim 128 (FWD_TILES: BLOCK_M 128, BLOCK_N 64, 4 warps)", fs=7.2, ha="left",
          weight="bold")  # fmt: skip
    qx, qy, qw, qh = 40, 4.5, 26, 11
    for w in range(4):
        yy = qy + qh - (w + 1) * qh / 4
        box(ax, qx, yy, qw, qh / 4, "reg", text=f"warp {w}: rows {32 * w}-{32 * w + 31} (2 slabs of 16)", fs=6.2)
    label(ax, qx + qw / 2, qy - 1.9, "Q tile (128 x d): split across warps", fs=6.3)
    box(ax, 70, 4.5, 9, 11, "smem", text="K_j, V_j\n64 keys\nshared by\nall 4 warps", fs=6.2)
    label(ax, 81, 10.6, "each warp: S slab (32 x 64), its own m, l\nand O rows (32 x d) in registers;\nrow max and "
          "sum reduce over the 4\nthreads of a quad (shuffles): no\ncross-warp exchange in the loop", fs=6.3, ha="left")  # fmt: skip
    legend(ax, 62, 22.5, fs=6.5)


# ---------------------------------------------------------------------------------------------
# 2. Which K/V blocks a query tile visits (causal and ragged masks)
# ---------------------------------------------------------------------------------------------


def fig_forward_masks():
    ax = canvas("forward-masks.svg", 124, 62)
    title(ax, 2, 59.5, "Which K/V blocks a query tile visits (AttnMask, masks.cuh); BLOCK_M = 2 x BLOCK_N as at head dim 128")

    def grid(x0, y0, n_m, n_n, cw, ch, causal, head):
        label(ax, x0 + n_n * cw / 2, y0 + n_m * ch + 3.0, head, fs=7.5, weight="bold")
        per = 2  # key blocks per query tile on the diagonal
        for m in range(n_m):
            for n in range(n_n):
                x, y = x0 + n * cw, y0 + (n_m - 1 - m) * ch
                if causal:
                    visited, masked = n < per * (m + 1), n >= per * m
                else:
                    visited, masked = True, n == n_n - 1
                if not visited:
                    box(ax, x, y, cw, ch, "plain", lw=0.5)
                elif masked:
                    box(ax, x, y, cw, ch, "reg", dark=True, lw=0.5, hatch="////")
                else:
                    box(ax, x, y, cw, ch, "reg", lw=0.5)
            label(ax, x0 - 1.2, y0 + (n_m - 1 - m) * ch + ch / 2, f"m={m}", fs=6, ha="right")
        for n in range(n_n):
            label(ax, x0 + n * cw + cw / 2, y0 - 1.4, f"j={n}", fs=6)
        label(ax, x0 + n_n * cw / 2, y0 - 3.6, "K/V blocks (BLOCK_N keys)", fs=6.5)
        label(ax, x0 - 6.2, y0 + n_m * ch / 2, "query tiles (BLOCK_M rows)", fs=6.5, rot=90)

    cw, ch = 4.6, 9.2
    x0, y0 = 20, 12
    grid(x0, y0, 4, 8, cw, ch, True, "causal, seqlen_q = seqlen_k")
    m = 2
    ym = y0 + (4 - 1 - m) * ch + ch / 2
    arrow(ax, (x0 + 5.8 * cw, ym), (x0 + 0.2 * cw, ym), color=INK, lw=1.1)
    label(ax, x0 + 8 * cw + 1.5, ym, "tile m = 2 visits blocks\nj = 5, 4 (masked), then\n3, 2, 1, 0 (no mask)",
          fs=6.3, ha="left")  # fmt: skip
    label(ax, x0 + 8 * cw + 1.5, y0 + 3.5 * ch, "above the diagonal:\nnever loaded", fs=6.3, ha="left", color="#666666")
    for m in range(4):
        label(ax, x0 - 11.5, y0 + (4 - 1 - m) * ch + ch / 2, f"x={3 - m}", fs=5.8, color="#666666")
    label(ax, x0 - 11.5, y0 + 4 * ch + 1.6, "blockIdx.x", fs=5.6, color="#666666")

    grid(80, 21, 3, 7, cw, ch * 0.8, False, "not causal, seqlen_k not a multiple of BLOCK_N")
    label(ax, 80 + 7 * cw + 1.2, 21 + 1.2 * ch, "keys past\nseqlen_k:\nzero-filled\nrows,\nmasked", fs=6.3, ha="left")

    legend(ax, 12, 2.4, kinds=(), extra=(
        (dict(fc=KINDS["reg"]["fc"], ec=KINDS["reg"]["ec"], lw=0.7), "visited, no mask arithmetic"),
        (dict(fc=KINDS["reg"]["dark"], ec=KINDS["reg"]["ec"], lw=0.7, hatch="////"), "visited, per-element mask (block_needs_mask)"),
        (dict(fc="white", ec="#777777", lw=0.7), "never visited: no load, no MMA"),
    ), fs=6.5)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3. Backward data flow
# ---------------------------------------------------------------------------------------------


def fig_backward():
    ax = canvas("backward.svg", 124, 104)
    title(ax, 2, 101.5, "Backward (flash_bwd.cuh): three launches; the main kernel has one CTA per key block")

    # Launch 1: preprocess.
    panel(ax, 2, 83, 120, 15)
    label(ax, 4, 96, "1  flash_bwd_pre_kernel: one warp per query row", fs=7.5, ha="left", weight="bold")
    box(ax, 6, 88.6, 20, 4.4, "hbm", text="O, dO  (row i of each)", fs=6.6)
    box(ax, 6, 84.2, 20, 3.6, "hbm", text="lse (forward's)", fs=6.6)
    box(ax, 44, 85, 38, 7.4, "reg", text="D_i = sum_d dO[i][d] O[i][d]\nlse_log2_i = lse_i * log2(e)  (+inf where lse_i = -inf\nand on padding rows: their P is exactly 0)", fs=6.4)
    box(ax, 96, 85.5, 22, 6.4, "hbm", text="D, lse_log2 (fp32)\npadded to whole blocks", fs=6.6)
    arrow(ax, (26, 90.8), (44, 90))
    arrow(ax, (26, 86), (44, 87))
    arrow(ax, (82, 88.7), (96, 88.7))

    # Launch 2: main kernel.
    panel(ax, 2, 20, 120, 61)
    label(ax, 4, 79, "2  flash_bwd_kernel: CTA (n, hk, b) owns keys [n*BLOCK_N, (n+1)*BLOCK_N) of kv head hk",
          fs=7.5, ha="left", weight="bold")  # fmt: skip
    column_head(ax, 4, 20, 74.5, "HBM", "hbm")
    column_head(ax, 30, 24, 74.5, "shared memory", "smem")
    column_head(ax, 60, 34, 74.5, "registers (per warp tile)", "reg")
    column_head(ax, 100, 20, 74.5, "HBM", "hbm")

    box(ax, 6, 64, 16, 6, "hbm", text="K_n, V_n", fs=6.8)
    box(ax, 32, 64, 20, 6, "smem", text="sK, sV: loaded once,\nkept for the whole loop", fs=6.5)
    arrow(ax, (22, 67), (32, 67), "cp.async", toff=(0, 1.3))

    box(ax, 6, 46, 16, 12, "hbm", text="Q_m, dO_m,\nlse_log2_m, D_m\nfor every query\nblock m that sees\nthese keys", fs=6.3)
    box(ax, 32, 52, 20, 6, "smem", text="stage it % 2: Q, dO,\nlse_log2, D of block it", fs=6.3)
    box(ax, 32, 45.5, 20, 5.5, "smem", text="other stage: block it+1\n(in flight)", fs=6.3, ls="--")
    arrow(ax, (22, 52), (32, 50), "cp.async", toff=(0, 1.3))
    label(ax, 14, 42.5, "loop: query heads of the\nGQA group x query blocks", fs=6.3, style="italic")

    box(ax, 60, 58, 34, 12, "reg",
        text="S^T = K Q^T,   dP^T = V dO^T\nP^T = exp2(S^T*scale*log2e - lse_log2)\ndS^T = P^T * (dP^T - D)", fs=6.6)  # fmt: skip
    arrow(ax, (52, 66), (60, 65))
    arrow(ax, (52, 55), (60, 60.5))
    box(ax, 32, 34, 20, 7, "smem", text="sP, sdS (16-bit)\nrows = keys", fs=6.5)
    arrow(ax, (60, 58.5), (52, 39), "stored for the\nnext two phases", toff=(6.5, 3.4), fs=6.2)

    box(ax, 60, 38, 34, 9, "reg", text="dV += P^T dO,  dK += dS^T Q\n(accumulated over the whole loop)", fs=6.6)
    arrow(ax, (52, 37.5), (60, 41))
    box(ax, 60, 24, 34, 9, "reg", text="dQ part = dS K_n\n(this CTA's BLOCK_N keys only)", fs=6.6)
    arrow(ax, (52, 36), (60, 29))

    box(ax, 102, 40, 16, 6, "hbm", text="dK, dV\nwritten once", fs=6.6)
    arrow(ax, (94, 42.5), (102, 43), "after the loop:\ndK *= scale", toff=(0, 3.2), fs=6.2)
    box(ax, 102, 23, 16, 8, "hbm", text="dq_accum (fp32)\nzeroed before", fs=6.6)
    arrow(ax, (94, 28.5), (102, 27), "red.global\n.add.v4.f32", toff=(0, 3.2), fs=6.2)

    ax.plot([94, 103], [66, 64.5], color=RED, lw=1.1, ls="--", zorder=3)
    cross(ax, 104.6, 64.2)
    label(ax, 110, 58.5, "S, P, dP, dS never\nreach HBM", fs=6.8, color=RED, weight="bold")
    legend(ax, 4, 22, fs=6.5)

    # Launch 3: convert.
    panel(ax, 2, 2, 120, 16)
    label(ax, 4, 16, "3  flash_bwd_convert_kernel: one CTA per query block", fs=7.5, ha="left", weight="bold")
    box(ax, 6, 5, 22, 7, "hbm", text="dq_accum tile m (fp32,\nregister order; all\nkey blocks added)", fs=6.4)
    box(ax, 40, 5, 34, 7, "smem", text="dQ = dq_accum * scale, in q's dtype,\nstaged as rows", fs=6.6)
    box(ax, 90, 5, 22, 7, "hbm", text="dQ (dtype of q)", fs=6.6)
    arrow(ax, (28, 8.5), (40, 8.5), "coalesced\nreads", toff=(0, 2.6), fs=6.2)
    arrow(ax, (74, 8.5), (90, 8.5), "16-byte stores", toff=(0, 1.3), fs=6.2)


# ---------------------------------------------------------------------------------------------
# 4. Backward: the dQ accumulation
# ---------------------------------------------------------------------------------------------


def fig_backward_dq():
    ax = canvas("backward-dq.svg", 124, 58)
    title(ax, 2, 55.5, "dQ accumulation: every key-block CTA adds its part into the fp32 tile of each query block it visits")

    def matrix(x0, y0, cell, n_m, n_n, numbered):
        for m in range(n_m):
            for n in range(n_n):
                x, y = x0 + n * cell, y0 + (n_m - 1 - m) * cell
                if n <= m:  # causal, square, BLOCK_M = BLOCK_N: key block n is seen by query blocks m >= n
                    box(ax, x, y, cell, cell, "reg", lw=0.5)
                    if numbered:
                        label(ax, x + cell / 2, y + cell / 2, f"turn {n}", fs=5.6)
                else:
                    box(ax, x, y, cell, cell, "plain", lw=0.5)
            label(ax, x0 - 1.0, y0 + (n_m - 1 - m) * cell + cell / 2, f"m={m}", fs=6, ha="right")
        for n in range(n_n):
            label(ax, x0 + n * cell + cell / 2, y0 + n_m * cell + 1.3, f"CTA n={n}", fs=5.8)
        label(ax, x0 + n_n * cell / 2, y0 - 2.0, "key-block CTAs (columns) x query blocks (rows), causal", fs=6.3)

    cell = 5.6
    y0 = 15
    # Left: atomic.
    label(ax, 4, 49.5, "default: fp32 atomics, any order", fs=7.8, ha="left", weight="bold")
    x0 = 10
    matrix(x0, y0, cell, 5, 5, False)
    bx = x0 + 5 * cell + 10
    for m in range(5):
        y = y0 + (5 - 1 - m) * cell
        box(ax, bx, y + 0.4, 10, cell - 0.8, "hbm", text=f"dq_accum m={m}", fs=5.8)
    m = 3
    ym = y0 + (5 - 1 - m) * cell + cell / 2
    for n in range(m + 1):
        arrow(ax, (x0 + n * cell + cell / 2, ym - 1.2), (bx, ym - 0.4 + 0.25 * n), color=KINDS["hbm"]["ec"], lw=0.7,
              rad=-0.25)  # fmt: skip
    label(ax, 4, 7.2, "each CTA adds dQ_part = dS K_n with warp-wide red.global.add.v4.f32\n(sm_90+; four scalar atomicAdd "
          "on older GPUs): 512 contiguous bytes per instruction\n(register order); the order of the additions varies run to run",
          fs=6.2, ha="left")  # fmt: skip

    # Right: deterministic.
    label(ax, 66, 49.5, "deterministic=True: turn counters, fixed order", fs=7.8, ha="left", weight="bold")
    x0 = 72
    matrix(x0, y0, cell, 5, 5, True)
    bx = x0 + 5 * cell + 4
    for m in range(5):
        y = y0 + (5 - 1 - m) * cell
        box(ax, bx, y + 0.4, 14, cell - 0.8, "hbm", text=f"dq_accum m={m}\nturn[m] (int32)", fs=5.6)
    label(ax, 66, 7.2, "CTA n, at query block m: thread 0 spins until ld.acquire(turn[m]) == n;\n__syncthreads; add; "
          "__threadfence; __syncthreads; red.release(turn[m] += 1).\nKey blocks 0 .. n-1 all visit m too, so the turns run "
          "0, 1, 2, ...", fs=6.2, ha="left")  # fmt: skip
    legend(ax, 4, 1.6, kinds=("hbm",), extra=(
        (dict(fc=KINDS["reg"]["fc"], ec=KINDS["reg"]["ec"], lw=0.7), "CTA n computes a dQ part for block m (registers)"),
        (dict(fc="white", ec="#777777", lw=0.7), "not visited (causal)"),
    ), fs=6.5)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 5. Decode: packed GQA rows and split-KV CTAs
# ---------------------------------------------------------------------------------------------


def fig_decode():
    ax = canvas("decode.svg", 124, 84)
    title(ax, 2, 81.5, "Decode (flash_decode.cuh): packed GQA rows, split-KV CTAs, a partial (O, lse) per split")

    # (a) packing.
    panel(ax, 2, 44, 48, 34)
    label(ax, 4, 75.5, "a  query rows of kv head hk, packed into M", fs=7.5, ha="left", weight="bold")
    label(ax, 4, 72, "group = nheads / nheads_kv = 4, seqlen_q = 2", fs=6.5, ha="left")
    rows = [(i, j) for i in range(2) for j in range(4)]
    for r, (i, j) in enumerate(rows):
        y = 68.5 - r * 2.1
        box(ax, 6, y - 0.95, 20, 1.9, "smem", text=f"r={r}: token {i}, head 4hk+{j}", fs=5.8)
    box(ax, 6, 49.2, 20, 3.3, "grey", text="r=8..15: zero rows", fs=5.8)
    label(ax, 16, 47.2, "sQ: one 16-row slab (m_slabs = 1)", fs=6.0)
    label(ax, 29, 60, "r = i * group + j\n\nthe 8 real rows fill the M\ndimension of m16n8k16:\none pass over the "
          "K/V of\nkv head hk serves all 4\nquery heads; the padding\nrows cost tensor-core\ncycles that a memory-"
          "\nbound kernel has spare", fs=6.1, ha="left")  # fmt: skip

    # (b) CTA warps.
    panel(ax, 52, 44, 70, 34)
    label(ax, 54, 75.5, "b  one split CTA: 4 warps = m_slabs x (4 / m_slabs)", fs=7.5, ha="left", weight="bold")
    label(ax, 54, 72, "one slab: the 4 warps split each 64-key tile into 16-key columns", fs=6.5, ha="left")
    for w in range(4):
        box(ax, 56 + w * 9, 56.5, 8.6, 12, "reg", text=f"warp {w}\nkeys\n{16 * w}-{16 * w + 15}\nown m, l, O", fs=5.9)
    box(ax, 56, 50.5, 35.4, 4.4, "smem", text="K/V tiles: a 2-4 stage cp.async ring", fs=6.2)
    label(ax, 94, 62.5, "each warp: S = Q K^T,\nonline softmax and\nO += P V over its own\nkeys (WarpTile);\n"
          "at the end the 4\nresults merge once\nthrough shared memory", fs=6.2, ha="left")  # fmt: skip
    label(ax, 56, 47, "m_slabs = 2: 2 x 2 warps; m_slabs = 4: 4 x 1 (one warp per slab)", fs=6.2, ha="left")

    # (c) splits.
    panel(ax, 2, 1, 120, 41)
    label(ax, 4, 39.5, "c  the keys of one (sequence b, kv head hk) in splits; grid = (num_splits x row blocks, nheads_kv, batch)",
          fs=7.5, ha="left", weight="bold")  # fmt: skip
    cx, cy, cw, ch = 8, 29, 104, 4.4
    box(ax, cx, cy, cw, ch, "hbm")
    vlines(ax, cx, cy, cw, ch, 26, "hbm")
    label(ax, cx - 1, cy + ch / 2, "K, V", fs=6.5, ha="right")
    label(ax, cx + cw / 2, cy + ch + 1.6, "the L_b keys of the sequence (cached + appended) in 64-key tiles: 26 tiles, "
          "4 splits of ceil(26 / 4) = 7 tiles", fs=6.3)  # fmt: skip
    splits = [(0, 7), (7, 14), (14, 21), (21, 26)]
    for s, (a, b) in enumerate(splits):
        x = cx + cw * a / 26
        w = cw * (b - a) / 26
        ax.plot([x, x], [cy - 1.6, cy + ch + 0.2], color=INK, lw=1.1, zorder=4)
        box(ax, x + 1, 17.5, w - 2, 6.5, "reg", text=f"CTA (split {s}, hk, b)\nonline softmax over its tiles", fs=6.2)
        arrow(ax, (x + w / 2, cy), (x + w / 2, 24))
        box(ax, x + 2, 8.5, w - 4, 5.5, "hbm", text=f"O_{s} (fp32, normalized), lse_{s}", fs=6.2)
        arrow(ax, (x + w / 2, 17.5), (x + w / 2, 14))
    ax.plot([cx + cw, cx + cw], [cy - 1.6, cy + ch + 0.2], color=INK, lw=1.1, zorder=4)
    label(ax, 62, 6.3, "partial rows in a workspace (num_splits, batch, nheads, seqlen_q, bucket); with one split the CTA "
          "writes O and lse directly", fs=6.2)  # fmt: skip
    legend(ax, 6, 3, fs=6.5)


# ---------------------------------------------------------------------------------------------
# 6. Decode: where the splits merge
# ---------------------------------------------------------------------------------------------


def fig_decode_merge():
    ax = canvas("decode-merge.svg", 124, 63)
    title(ax, 2, 60.5, "Where the partial results of the splits merge")
    label(ax, 62, 54.6, "lse = log sum_s exp(lse_s)      O = sum_s exp(lse_s - lse) O_s\n"
          "computed as  m = max_s lse_s,  w_s = exp(lse_s - m),  l = sum_s w_s,  O = (sum_s w_s O_s) / l,  lse = m + ln l",
          fs=7, weight="bold")  # fmt: skip

    # Left: in-kernel.
    panel(ax, 2, 2, 58, 50)
    label(ax, 4, 49.5, "in the split kernel (<= 64 partial rows per group of CTAs)", fs=7.5, ha="left", weight="bold")
    for s in range(4):
        y = 40 - s * 6.2
        box(ax, 4, y, 15, 5, "reg", text=f"CTA split {s}", fs=6.3, dark=(s == 2))
        box(ax, 22, y, 11, 5, "hbm", text=f"O_{s}, lse_{s}", fs=6.3)
        arrow(ax, (19, y + 2.5), (22, y + 2.5))
    box(ax, 40, 31, 17, 8, "hbm", text="counter[b, hk, rb]\natomicAdd", fs=6.3)
    for s in range(4):
        y = 40 - s * 6.2 + 2.5
        arrow(ax, (33, y), (40, 35), color="#777777", lw=0.6)
    box(ax, 40, 15, 17, 11, "reg", dark=True, text="last CTA to count\n(here split 2):\nresets the counter,\nmerges the group", fs=6.2)
    arrow(ax, (48.5, 31), (48.5, 26))
    label(ax, 4, 10.5, "each CTA: __threadfence (its partial rows reach device\nscope), __syncthreads, then one atomicAdd; "
          "the CTA that\nsees num_splits - 1 stages all partial rows into its free\nK/V stages (cp.async, through L2) and merges them",
          fs=6.1, ha="left")  # fmt: skip

    # Right: combine kernel.
    panel(ax, 62, 2, 60, 50)
    label(ax, 64, 49.5, "combine kernel (> 64 partial rows per group of CTAs)", fs=7.5, ha="left", weight="bold")
    for s in range(4):
        y = 40 - s * 6.2
        box(ax, 64, y, 15, 5, "reg", text=f"CTA split {s}", fs=6.3)
        box(ax, 82, y, 11, 5, "hbm", text=f"O_{s}, lse_{s}", fs=6.3)
        arrow(ax, (79, y + 2.5), (82, y + 2.5))
    box(ax, 100, 24, 20, 16, "reg",
        text="flash_decode_combine\none CTA per output\nrow; thread s loads\nlse_s; warp w adds\nsplits w, w+4, ...", fs=6.2)  # fmt: skip
    for s in range(4):
        y = 40 - s * 6.2 + 2.5
        arrow(ax, (93, y), (100, 32), color="#777777", lw=0.6)
    label(ax, 64, 11, "a second launch (programmatic dependent launch on sm_90+);\nlean variant: 4 partial rows in flight per warp, "
          "8 CTAs per SM;\nwide variant: up to 32 in flight (16 above head dim 128), 2 CTAs per SM;\nthe same bits either way",
          fs=6.1, ha="left")  # fmt: skip
    box(ax, 104, 5, 14, 5, "hbm", text="O, lse", fs=6.3)
    arrow(ax, (110, 24), (110, 10))
    box(ax, 40, 4.5, 17, 5, "hbm", text="O, lse", fs=6.3)
    arrow(ax, (48.5, 15), (48.5, 9.5))
    arrow(ax, (29, 21.8), (40, 19.5), "reads every\nO_s, lse_s", color=KINDS["hbm"]["ec"], ls="--", lw=0.8,
          toff=(-3.5, -3.2), fs=5.8)  # fmt: skip
    label(ax, 48.5, 40.6, "then count", fs=5.8, color="#555555")
    legend(ax, 70, 59.3, kinds=("hbm", "reg"), fs=6.3)


# ---------------------------------------------------------------------------------------------
# 7. Decode grid shapes (SM slots over time)
# ---------------------------------------------------------------------------------------------


def fig_decode_grids():
    ax = canvas("decode-grids.svg", 124, 64)
    title(ax, 2, 61.5, "Decode grid shapes: CTAs on the SM slots over time (schematic: 6 slots, 8 or 16 groups)")
    sh = 2.0  # slot height

    def lane(x0, y0, slots, bars, head, note):
        """bars: (slot, start, length, kind, text); the lane's top is at y0."""
        panel(ax, x0 - 2, y0 - slots * sh - 8, 57, slots * sh + 12)
        label(ax, x0, y0 + 2, head, fs=7.4, ha="left", weight="bold")
        label(ax, x0, y0 - slots * sh - 4, note, fs=6.1, ha="left")
        ax.plot([x0, x0], [y0 - slots * sh, y0], color="#999999", lw=0.6)
        for s, t0, ln, kind, text in bars:
            fc = {"long": KINDS["reg"]["fc"], "tail": KINDS["reg"]["dark"], "whole": KINDS["hbm"]["fc"]}[kind]
            ax.add_patch(Rectangle((x0 + t0, y0 - (s + 1) * sh + 0.15), ln, sh - 0.3, fc=fc, ec="#666666", lw=0.5,
                                   zorder=2))  # fmt: skip
            if text:
                label(ax, x0 + t0 + ln / 2, y0 - (s + 0.5) * sh, text, fs=5.4)

    u = 12.0  # length of an equal split
    # Equal splits: 8 groups x 2 splits = 16 CTAs on 6 slots: 3 waves, the last 4 of 6 full.
    bars = [(c % 6, (c // 6) * u, u - 0.3, "long", "") for c in range(16)]
    lane(4, 54, 6, bars, "equal splits (decode_num_splits)",
         "8 groups x 2 splits on 6 slots: 3 waves, the last one\nwith 2 slots idle")  # fmt: skip

    # Filled grid: 2 long splits of 4/9 of the keys + a tail of 1/9 per group; tails in the 2 free slots, 4 rounds.
    lg = u * 2 * 4 / 9
    bars = [(c % 6, (c // 6) * lg, lg - 0.3, "long", "") for c in range(16)]
    bars += [(4 + k % 2, 2 * lg + (k // 2) * lg / 4, lg / 4 - 0.2, "tail", "") for k in range(8)]
    lane(65, 54, 6, bars, "filled grid (_filled_grid)",
         "the same 2 long splits, a little shorter, and one short tail\nsplit per group, started last (split-major grid), "
         "in rounds\nthrough the 2 slots the last wave leaves free")  # fmt: skip

    # Tail-split grid: 16 whole groups on 6 slots: 2 full waves + 4 groups left, split 3 ways -> 12 short CTAs.
    w = 14.0
    bars = [(c % 6, (c // 6) * w, w - 0.3, "whole", "") for c in range(12)]
    bars += [(k % 6, 2 * w + (k // 6) * (w / 3 + 0.6), w / 3 + 0.3, "tail", "") for k in range(12)]
    lane(4, 27, 6, bars, "tail-split grid (_tail_split, _deep_grid)",
         "16 whole groups: 2 full waves, then the 4 left over (a wave\n<= 70% full) split 3 ways and started last "
         "(1-D grid),\nmerged in the kernel; deep grid: the same at 3 CTAs per SM")  # fmt: skip

    # Unsplit wave: one whole group per SM.
    bars = [(k, 0, 3 * u, "whole", "one whole group per SM") for k in range(6)]
    lane(65, 27, 6, bars, "unsplit wave (_unsplit_wave)",
         "slots = SMs here: about as many groups as SMs (95-100%),\n3072-16384 keys each; one CTA per SM (shared memory\npadded), no partial rows, no merge")  # fmt: skip
    label(ax, 4, 2.4, "time ->", fs=6.2, ha="left", style="italic")
    legend(ax, 22, 2.4, kinds=(), extra=(
        (dict(fc=KINDS["reg"]["fc"], ec="#666666", lw=0.5), "split CTA"),
        (dict(fc=KINDS["reg"]["dark"], ec="#666666", lw=0.5), "short (tail) split CTA"),
        (dict(fc=KINDS["hbm"]["fc"], ec="#666666", lw=0.5), "whole (unsplit) group"),
    ), fs=6.3)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 8. Work split over CTAs, warps and warpgroups
# ---------------------------------------------------------------------------------------------


def fig_work_split():
    ax = canvas("work-split.svg", 124, 118)
    title(ax, 2, 115.5, "Who computes what inside a CTA (examples at head dim 128; tiles from cuflash/plan/)")
    legend(ax, 80, 115.5, fs=6.5)

    # (a) mma.sync forward.
    panel(ax, 2, 78, 58, 34)
    label(ax, 4, 109.5, "a  forward, mma.sync: 128 query rows, 4 warps", fs=7.5, ha="left", weight="bold")
    for w in range(4):
        y = 100 - w * 5
        box(ax, 6, y, 22, 4.6, "reg", text=f"warp {w}: rows {32 * w}-{32 * w + 31}", fs=6.2)
        box(ax, 29, y + 2.3, 2.4, 2.3, "grey")
        box(ax, 29, y, 2.4, 2.3, "grey")
    label(ax, 17, 82.5, "S, P, O rows of a warp: 2 slabs of 16\n(one m16n8k16 row block each)", fs=6.2)
    box(ax, 36, 86, 18, 18.6, "smem", text="K_j, V_j\n(64 keys)\nread by\nevery warp", fs=6.3)
    label(ax, 30.2, 106.2, "2 slabs of 16", fs=5.8)

    # (b) wgmma forward.
    panel(ax, 64, 78, 58, 34)
    label(ax, 66, 109.5, "b  forward, wgmma (sm_90a): 128 rows, 2 warpgroups", fs=7.5, ha="left", weight="bold")
    for g in range(2):
        y = 94.5 - g * 11
        box(ax, 68, y, 30, 10.6, "reg", lw=1.4)
        label(ax, 69, y + 9.3, f"warpgroup {g}: rows {64 * g}-{64 * g + 63}", fs=6.2, ha="left")
        for i in range(4):
            box(ax, 69 + i * 7, y + 0.6, 6.6, 6.6, "reg", dark=True, text=f"warp\n{4 * g + i}\n16 rows", fs=5.6)
    box(ax, 101, 84, 18, 20.6, "smem", text="Q, K_j, V_j\n128-byte\nswizzled\ntiles read by\nwgmma from\nshared memory",
        fs=6.1)  # fmt: skip
    label(ax, 83, 81, "one wgmma m64n128k16 per warpgroup and k-step;\nwarp i holds rows 16i.. of the accumulator", fs=6.0)

    # (c) mma.sync backward phases.
    panel(ax, 2, 36, 120, 39)
    label(ax, 4, 72.5, "c  backward, mma.sync: 128 keys x 64 queries per iteration, 8 warps; each phase has its own grid of warp tiles",
          fs=7.5, ha="left", weight="bold")  # fmt: skip

    def warp_grid(x0, y0, rows, cols, rw, cw, head, rlab, clab, kind="reg"):
        label(ax, x0 + cols * cw / 2, y0 + rows * rw + 2.2, head, fs=6.6, weight="bold")
        for r in range(rows):
            for c in range(cols):
                w = r + rows * c  # warp index: warp % key_warps along the rows
                box(ax, x0 + c * cw, y0 + (rows - 1 - r) * rw, cw, rw, kind, text=f"w{w}", fs=5.8)
        label(ax, x0 + cols * cw / 2, y0 - 1.6, clab, fs=6.0)
        label(ax, x0 - 1.4, y0 + rows * rw / 2, rlab, fs=6.0, rot=90)

    warp_grid(10, 42, 4, 2, 5, 8, "S^T, dP^T (128 x 64)", "keys (4 x 32)", "queries (2 x 32)")
    warp_grid(44, 42, 4, 2, 5, 12, "dK, dV (128 x 128)", "keys (4 x 32)", "head dim (2 x 64)")
    warp_grid(84, 47, 2, 4, 5, 7, "dQ part (64 x 128)", "queries (2 x 32)", "head dim (4 x 32)")
    label(ax, 84, 41.5, "BWD_TILES[128]: s_key_warps 4,\nkv_key_warps 4, dq_q_warps 2", fs=6.0, ha="left")
    label(ax, 72, 38.2, "phases exchange data only through shared memory (sP, sdS): any warp may read any other warp's tile",
          fs=6.1)  # fmt: skip

    # (d) wgmma backward.
    panel(ax, 2, 2, 58, 31)
    label(ax, 4, 30.5, "d  backward, wgmma: 128 keys, 2 warpgroups", fs=7.5, ha="left", weight="bold")
    box(ax, 6, 16, 20, 10, "reg", text="warpgroup 0:\nkeys 0-63\nS^T, dP^T, P^T, dS^T,\ndK, dV", fs=5.9)
    box(ax, 28, 16, 20, 10, "reg", text="warpgroup 1:\nkeys 64-127\nS^T, dP^T, P^T, dS^T,\ndK, dV", fs=5.9)
    box(ax, 6, 6, 20, 7, "reg", dark=True, text="dQ columns 0 .. d/2\n(all 128 keys)", fs=5.9)
    box(ax, 28, 6, 20, 7, "reg", dark=True, text="dQ columns d/2 .. d\n(all 128 keys)", fs=5.9)
    box(ax, 50, 6, 8, 20, "smem", text="dS^T\nshared\nby both", fs=5.9)
    label(ax, 4, 3.4, "head dim 256: 64 keys; warpgroups split the head dim instead", fs=6.0, ha="left")

    # (e) decode.
    panel(ax, 64, 2, 58, 31)
    label(ax, 66, 30.5, "e  decode split CTA: 4 warps, slab rows x key columns", fs=7.5, ha="left", weight="bold")
    for i, (rows, cols) in enumerate(((1, 4), (2, 2), (4, 1))):
        x0 = 68 + i * 18
        cw, rh = 14 / cols, 3.6
        y0 = 9
        for r in range(rows):
            for c in range(cols):
                box(ax, x0 + c * cw, y0 + (4 - rows) * rh / 2 + (rows - 1 - r) * rh, cw, rh, "reg",
                    text=f"w{r * cols + c}", fs=5.6)
        label(ax, x0 + 7, 25, f"m_slabs = {rows}", fs=6.2, weight="bold")
        label(ax, x0 + 7, 6.3, f"{16 * rows} rows; {cols} key\ncolumn{'s' if cols > 1 else ''} of {64 // cols} keys", fs=5.8)
    label(ax, 93, 3.2, "each warp: its 16 rows x its keys of every tile", fs=6.0)


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# 9. Varlen: the tile scheduler over packed sequences
# ---------------------------------------------------------------------------------------------


def fig_varlen():
    ax = canvas("varlen.svg", 124, 58)
    title(ax, 2, 55.5, "Varlen: packed rows, the scheduler's slots f(b) = cu[b] // block + b, and the backward's scratch")
    lengths = [300, 40, 0, 520, 100]  # rows of each sequence (block = 128)
    block = 128
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    sx = 100.0 / cu[-1]  # x units per row
    x0, y_rows = 12.0, 44.0
    label(ax, 2, y_rows + 2, "packed q\n(total_q rows)", fs=6.6, ha="left")
    shades = ["#dbe8f6", "#dcefd8", "#ffffff", "#fde6cc", "#ece0f5"]
    for b, n in enumerate(lengths):
        if n:
            box(ax, x0 + cu[b] * sx, y_rows, n * sx, 4, color=shades[b], text=f"seq {b}: {n}", fs=6.4)
    for value in sorted(set(cu)):
        names = "=".join(f"cu[{b}]" for b in range(len(cu)) if cu[b] == value)
        label(ax, x0 + value * sx, y_rows - 1.6, f"{names}={value}", fs=5.4)
    label(ax, x0 + 100 + 1, y_rows + 2, "(seq 2 empty)", fs=5.6, ha="left")
    # Slots: f(b) .. f(b+1)-1; tiles of the sequence, then spare slots.
    f = [cu[b] // block + b for b in range(len(cu))]
    y_slots, w = 28.0, 100.0 / f[-1]
    label(ax, 2, y_slots + 2, "grid slots\n(blockIdx.x)", fs=6.6, ha="left")
    for b, n in enumerate(lengths):
        tiles = -(-n // block)
        for t in range(f[b], f[b + 1]):
            m = t - f[b]
            real = m < tiles
            box(ax, x0 + t * w, y_slots, w - 0.4, 4, color=shades[b] if real else "#ffffff",
                hatch=None if real else "////", text=f"{b}:{m}" if real else "spare", fs=5.6)
            label(ax, x0 + t * w + w / 2, y_slots - 1.5, str(t), fs=5.2)
        if b < len(lengths):
            label(ax, x0 + f[b] * w, y_slots + 6, f"f({b})={f[b]}", fs=5.4)
    arrow(ax, (x0 + 50, y_rows - 3.5), (x0 + 50, y_slots + 8.5),
          text="CTA t: the largest b with f(b) <= t (32-way warp search over cu), tile m = t - f(b)", fs=6.2,
          toff=(1, 0), ha="left")  # fmt: skip
    # Scratch rows.
    y_scr = 12.0
    label(ax, 2, y_scr + 2, "bwd scratch\n(lse_log2, D,\ndq_accum)", fs=6.6, ha="left")
    for t in range(f[-1]):
        b = max(i for i in range(len(lengths)) if f[i] <= t)
        m = t - f[b]
        real = m < -(-lengths[b] // block)
        box(ax, x0 + t * w, y_scr, w - 0.4, 4, kind="hbm", color=None if real else "#ffffff",
            hatch=None if real else "////", text=f"rows {t * block}.." if real else "", fs=5.2)
    label(ax, x0, y_scr - 3.5, "per head: slots x block rows; sequence b's tile m owns rows (f(b) + m) x block: "
          "no two sequences share a tile, the preprocess and convert kernels find their rows the same way",
          fs=6.0, ha="left")
    label(ax, x0, 3.0, "at most one spare slot per sequence (a CTA that exits at once): grid = total // block + batch; "
          "causal: each sequence's last (heaviest) tile takes its first slot", fs=6.0, ha="left")


# ---------------------------------------------------------------------------------------------
# Hopper forward: the warp-specialized pipeline (flash_fwd_sm90_ws.cuh)
# ---------------------------------------------------------------------------------------------


def fig_forward_sm90_ws():
    ax = canvas("forward-sm90-ws.svg", 124, 66)
    title(ax, 2, 63.5, "Hopper forward: producer warp, K/V ring, two consumer warpgroups (overlap + ping-pong)")
    # Shared memory: Q and the ring.
    y_sm = 49.0
    label(ax, 2, y_sm + 2.5, "shared\nmemory", fs=6.8, ha="left")
    box(ax, 12, y_sm, 14, 5, kind="smem", text="Q (128 x d)", fs=6.4)
    for s in range(2):
        box(ax, 28 + 30 * s, y_sm, 13, 5, kind="smem", text=f"K slot {s}", fs=6.4)
        box(ax, 42 + 30 * s, y_sm, 13, 5, kind="smem", text=f"V slot {s}", fs=6.4)
    box(ax, 90, y_sm, 30, 5, kind="smem", text="mbarriers: Q; full / empty\nper K and V slot", fs=6.0)
    # Timeline lanes.
    lanes = [("producer\n(1 thread)", 38.0), ("consumer WG 0\n(rows 0-63)", 27.0), ("consumer WG 1\n(rows 64-127)", 16.0)]
    for text, y in lanes:
        label(ax, 2, y + 2, text, fs=6.6, ha="left")
        ax.plot([12, 121], [y - 0.6, y - 0.6], color="#cccccc", lw=0.5, zorder=1)
    # Producer: TMA loads (HBM -> smem), waiting on "empty" before reusing a slot.
    x = 12.0
    for name, w in [("Q", 5), ("K0", 5), ("V0", 5), ("K1", 5), ("V1", 5)]:
        box(ax, x, 38, w - 0.4, 4, kind="hbm", text=name, fs=6.0)
        x += w
    box(ax, x, 38, 16, 4, kind="grey", text="wait empty K0", fs=5.8, ls="--")
    box(ax, x + 16, 38, 5, 4, kind="hbm", text="K2", fs=6.0)
    box(ax, x + 21, 38, 14, 4, kind="grey", text="wait empty V0", fs=5.8, ls="--")
    box(ax, x + 35, 38, 5, 4, kind="hbm", text="V2", fs=6.0)
    label(ax, x + 42, 40, "... (TMA: cp.async.bulk.tensor,\n128-byte swizzle, complete_tx)", fs=5.8, ha="left")

    # Consumers: GEMM issues (tensor cores) and softmax (CUDA cores).
    def wg(y, x0):
        xs = x0
        box(ax, xs, y, 6, 4, kind="reg", dark=True, text="S0", fs=6.0)
        box(ax, xs + 6.5, y, 9, 4, kind="reg", text="softmax 0", fs=5.8)
        xs += 16
        for t in (1, 2):
            box(ax, xs, y, 6, 4, kind="reg", dark=True, text=f"S{t}", fs=6.0)
            box(ax, xs + 6, y, 7, 4, kind="reg", dark=True, text=f"P{t - 1}V{t - 1}", fs=5.6)
            box(ax, xs + 6.5, y - 3.2, 9, 2.6, kind="reg", text=f"softmax {t}", fs=5.4)
            xs += 16
        return xs

    wg(27, 22)
    wg(16, 28)
    label(ax, 12, 9.5, "dark: GEMM issues (wgmma, tensor cores); light: softmax (CUDA cores). Within a warpgroup "
          "softmax t runs while P(t-1) V(t-1) is on the tensor cores (wait_group 1,", fs=6.0, ha="left")
    label(ax, 12, 6.5, "then O *= correction after wait_group 0). Between warpgroups: named barriers hand the "
          "tensor cores over at each issue (ping-pong), so WG 1's softmax hides WG 0's GEMMs.", fs=6.0, ha="left")
    label(ax, 12, 3.5, "A consumer releases a slot (arrive on its empty barrier) once its wgmma reading it has "
          "completed; the producer refills it. Epilogue: O staged in the freed slots, 16-byte stores.", fs=6.0, ha="left")


def fig_backward_sm90_ws():
    ax = canvas("backward-sm90-ws.svg", 124, 66)
    title(ax, 2, 63.5, "Hopper backward: producer warp, query-block ring, two consumer warpgroups (64 keys each)")
    y_sm = 49.0
    label(ax, 2, y_sm + 2.5, "shared\nmemory", fs=6.8, ha="left")
    box(ax, 12, y_sm, 9, 5, kind="smem", text="K (128 x d)", fs=6.0)
    box(ax, 22, y_sm, 9, 5, kind="smem", text="V (128 x d)", fs=6.0)
    for s in range(2):
        box(ax, 33 + 24 * s, y_sm, 23, 5, kind="smem", text=f"slot {s}: Q, dO (64 x d),\nlse_log2, D (64)", fs=5.8)
    box(ax, 82, y_sm, 16, 5, kind="smem", text="dS^T x 2\n(128 x 64)", fs=6.0)
    box(ax, 100, y_sm, 21, 5, kind="smem", text="mbarriers: K/V full;\nfull / empty per slot", fs=5.8)
    lanes = [("producer\n(1 thread)", 38.0), ("consumer WG 0\n(keys 0-63)", 27.0), ("consumer WG 1\n(keys 64-127)", 16.0)]
    for text, y in lanes:
        label(ax, 2, y + 2, text, fs=6.6, ha="left")
        ax.plot([12, 121], [y - 0.6, y - 0.6], color="#cccccc", lw=0.5, zorder=1)
    x = 12.0
    for name, w in [("K, V", 7), ("slot 0", 7), ("slot 1", 7)]:
        box(ax, x, 38, w - 0.4, 4, kind="hbm", text=name, fs=6.0)
        x += w
    box(ax, x, 38, 24, 4, kind="grey", text="wait empty slot 0", fs=5.8, ls="--")
    box(ax, x + 24, 38, 7, 4, kind="hbm", text="slot 0", fs=6.0)
    label(ax, x + 33, 40, "... (TMA tiles + bulk copies of the rows)", fs=5.8, ha="left")

    def wg(y, x0):
        xs = x0
        box(ax, xs, y, 5, 4, kind="reg", dark=True, text="S^T", fs=5.8)
        box(ax, xs + 5, y, 5, 4, kind="reg", dark=True, text="dP^T", fs=5.6)
        box(ax, xs + 5.5, y - 3.2, 7, 2.6, kind="reg", text="P^T = exp", fs=5.2)
        box(ax, xs + 12.5, y, 5, 4, kind="reg", dark=True, text="dV", fs=5.8)
        box(ax, xs + 13, y - 3.2, 7, 2.6, kind="reg", text="dS^T", fs=5.2)
        box(ax, xs + 20, y, 5, 4, kind="reg", dark=True, text="dK", fs=5.8)
        box(ax, xs + 25.5, y, 1.2, 4, kind="grey", text="", fs=5)
        box(ax, xs + 27, y, 6, 4, kind="reg", dark=True, text="dQ", fs=5.8)
        box(ax, xs + 33.5, y - 3.2, 6, 2.6, kind="hbm", text="red.add", fs=5.2)
        return xs + 40

    for y in (27, 16):
        xe = wg(y, 26)
        wg(y, xe)
    label(ax, 52.1, 32.0, "barrier", fs=5.2)
    label(ax, 12, 9.5, "dark: GEMM issues (wgmma, tensor cores); light: CUDA-core work under the GEMM in flight: the "
          "exponentials while dP^T runs, dS^T while dV runs.", fs=6.0, ha="left")
    label(ax, 12, 6.5, "A named barrier of the 256 consumer threads (grey) puts both halves of dS^T in shared memory "
          "before dQ = dS K over all 128 keys; dS^T is double buffered.", fs=6.0, ha="left")
    label(ax, 12, 3.5, "After dQ completes each warp releases the slot (empty barrier) and adds its dQ part to "
          "dq_accum (fp32 vector reductions); dK, dV stay in registers to the end.", fs=6.0, ha="left")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--png", metavar="DIR", help="also write PNG previews into DIR")
    args = ap.parse_args()
    for draw in (fig_forward, fig_forward_masks, fig_backward, fig_backward_dq, fig_decode, fig_decode_merge,
                 fig_decode_grids, fig_work_split, fig_varlen, fig_forward_sm90_ws, fig_backward_sm90_ws):  # fmt: skip
        draw()
    for name, fig in _figures:
        fig.savefig(OUT / name, format="svg", metadata={"Date": None, "Creator": "docs/design/figures/draw.py"})
        if args.png:
            Path(args.png).mkdir(parents=True, exist_ok=True)
            fig.savefig(Path(args.png) / name.replace(".svg", ".png"), format="png", dpi=110)
        plt.close(fig)
        print(f"wrote {OUT / name} ({(OUT / name).stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
