"""``specray profile --out cost.json``: the round-cost table of this machine (serving/cost_table.py):
the target's forward time by batch size and rows over a context, which the engine's chooser reads."""

from __future__ import annotations

from specray.capture.target import load_target
from specray.serving.cost_table import profile, table_summary


def profile_machine(target_name: str, out: str, *, dtype: str, batch_sizes: tuple[int, ...], rows: tuple[int, ...],
                    context_tokens: int, repeats: int, force: bool) -> None:
    """Time the forwards (progress on one line), save the table to ``out`` and print its summary."""
    target = load_target(target_name, dtype=dtype)

    def progress(done: int, total: int) -> None:
        print(f"\rprofile    {done}/{total} forwards timed", end="", flush=True)

    table = profile(target, batch_sizes=batch_sizes, rows=rows, context_tokens=context_tokens, repeats=repeats,
                    progress=progress)
    print()
    table.save(out, force=force)
    print(table_summary(table))
    print(f"wrote {out} (ms per forward over {table.context_tokens} context tokens, "
          f"{table.machine.cpu}, {table.machine.threads} threads, {table.machine.dtype})")
