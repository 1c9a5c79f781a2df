"""Plain-text and markdown tables for the CLI's reports."""


def render_table(header: list[str], lines: list[list[str]], markdown: bool = False) -> str:
    """Rows of strings as a markdown table, or as aligned plain-text columns."""
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max([len(h)] + [len(c[i]) for c in lines]) for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])


def index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
