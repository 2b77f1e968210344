"""`validate --plot`: a PNG of the logit error per position, and per layer where hidden states compare."""

from __future__ import annotations

from pathlib import Path

from mconvert.errors import MConvertError


def plot_errors(
    path: Path, per_position: dict[str, list[float]], per_layer: dict[str, list[float]], title: str
) -> Path:
    """Write the PNG (matplotlib, Agg backend: no display needed). Log scale; zeros drawn at 1e-12."""
    # heavy optional import, only when a plot is asked for
    import matplotlib

    matplotlib.use("Agg")
    # heavy optional import, only when a plot is asked for
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ncols = 2 if per_layer else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.2), squeeze=False)
    ax = axes[0][0]
    for label, ys in per_position.items():
        ax.plot(range(len(ys)), [max(y, 1e-12) for y in ys], marker=".", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("max |logit − ref logit|")
    ax.set_title("error per position")
    ax.grid(True, which="both", alpha=0.3)
    if per_position:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no comparable logits", ha="center", transform=ax.transAxes)
    if per_layer:
        ax2 = axes[0][1]
        for label, ys in per_layer.items():
            ax2.plot(range(len(ys)), [max(y, 1e-12) for y in ys], marker="o", label=label)
        ax2.set_yscale("log")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_xlabel("layer (0 = embeddings)")
        ax2.set_ylabel("max |hidden − ref hidden|")
        ax2.set_title("error per layer")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise MConvertError(f"--plot {path}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)
    return path
