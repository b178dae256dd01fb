"""`python -m xeontune.train` (what the launcher starts on every rank) and `xeontune train`."""

from __future__ import annotations

import logging
import os
import sys

from xeontune.errors import TrainingError, UserError
from xeontune.quiet import quiet_libraries


def _configure_logging() -> None:
    rank = int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0")))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(levelname)s %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s",
    )
    quiet_libraries()


def main(argv: list[str] | None = None) -> int:
    # Whole lines only: mpirun prefixes each line with its rank, and half-lines get glued together.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    _configure_logging()
    try:
        from xeontune.train.loop import train
        from xeontune.train.options import parse_args

        opts = parse_args(list(sys.argv[1:] if argv is None else argv))
        result = train(opts)
        if result.embeds_path:
            print(f"wrote {result.embeds_path} (loss {result.final_loss:.4f} after {result.steps} steps)")
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # Re-exec once with tcmalloc (or jemalloc) preloaded when this host has it; XEONTUNE_ALLOCATOR=none
    # turns this off. Only here and in the CLI: a caller importing main() keeps its own process.
    from xeontune.hardware import reexec_with_allocator

    reexec_with_allocator(["-m", "xeontune.train", *sys.argv[1:]])
    sys.exit(main())
