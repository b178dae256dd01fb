"""`python -m xeontune.train` (what the launcher starts on every rank) and `xeontune train`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import xeontune.train.methods.declaration as methods
from xeontune.errors import TrainingError, UserError
from xeontune.quiet import quiet_libraries
from xeontune.train.outputs import learned_file


def _configure_logging() -> None:
    rank = int(_rank())
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(levelname)s %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s",
    )
    quiet_libraries()


def _stop_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP stop a rank the way Ctrl-C does (KeyboardInterrupt), so that its files are
    closed and it says so; mpirun passes SIGINT/SIGTERM on to every rank (xeontune/job/process.py), and
    scancel sends SIGTERM to every srun task."""
    def stop(sig: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(sig).name)

    if threading_is_main():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop)


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def main(argv: list[str] | None = None) -> int:
    """A rank (or `xeontune train`): the exit status. The signal handlers it installs are the caller's
    again when it returns: `xeontune train` run in-process (``cli.main``) leaves the process as it was."""
    signals = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
    saved = {sig: signal.getsignal(sig) for sig in signals} if threading_is_main() else {}
    try:
        return _main(argv)
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
    # CPU only: a visible GPU gives torch.distributed an accelerator that barriers without an
    # explicit CPU group would pick (cuda:<local rank>: "invalid device ordinal" on ranks 1..N).
    # Set before torch initialises CUDA; an explicit value (`launch --env`) is the user's.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    # Whole lines only: mpirun prefixes each line with its rank, and half-lines get glued together.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    try:  # under srun: Slurm's rank variables as the standard names, before anything reads them
        from xeontune.train.world import adopt

        adopt()
    except UserError as exc:
        say(f"error: {exc}")
        return exc.exit_code
    _configure_logging()
    _stop_like_ctrl_c()
    from xeontune.train import preempt

    preempt.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from xeontune.train.options import parse_args, require_dir

        opts = parse_args(argv)
        if opts.dataset:  # exported once into a folder of images and captions, which then is the data dir
            from xeontune.train import hf_dataset

            hf_dataset.resolve(opts)
        require_dir(opts.data_dir, "data dir")  # before seconds of imports (reading the images checks it again)
        from xeontune.train import ranks

        if opts.nproc_per_node != "1" and not ranks.inside_a_launch():
            plan, precision = _plan_ranks(opts)
            if plan.ranks > 1:
                ranks.prepare_shared_weights(opts, precision)
                from xeontune.job.engines import elastic
                from xeontune.train.hf_dataset import handed_to_ranks

                with handed_to_ranks(opts):  # the ranks take this export, not the dataset again
                    return elastic.run_ranks(argv, plan.ranks)
        # Before torch starts its threads: they inherit this thread's core affinity.
        from xeontune.placement import pin_this_rank

        pin_this_rank()
        from xeontune.train.loop import train

        result = train(opts)
        if result.result_path:
            loss = "no step left to train" if result.final_loss is None else f"loss {result.final_loss:.4f}"
            beside = [learned_file(stem) for stem in methods.get(opts.method).files[1:]  # LoRA: kohya's, a pivotal token's
                      if (result.output_dir / learned_file(stem)).is_file()]
            also = f" and beside it {', '.join(beside)}" if beside else ""
            print(f"wrote {result.result_path}{also} ({loss} after {result.steps} steps)")
        return 0
    except UserError as exc:
        say(f"error: {exc}")
        return exc.exit_code
    except TrainingError as exc:
        say(f"error: {exc}")
        return 1
    except preempt.Preempted as exc:
        say(f"checkpoint-{exc.step} written on {exc.signal_name}: stopped, to resume from it")
        if exc.signum == signal.SIGUSR1:  # the mark tells the batch script to requeue (it sees a preemption itself)
            preempt.mark()
        return exc.exit_code
    except KeyboardInterrupt as exc:
        name = str(exc.args[0]) if exc.args else "SIGINT"
        say(f"rank {_rank()} interrupted ({name}): stopped")
        return 128 + int(getattr(signal, name, signal.SIGINT))
    except RuntimeError as exc:
        if not another_rank_ended(exc):
            raise
        # Rank 0 alone checks some inputs (the output dir, the checkpoint to resume): it prints the
        # one-line error and exits, and every other rank's next collective finds its socket closed.
        say(f"rank {_rank()} stopped: another rank ended first (its message is above)")
        sys.stdout.flush()
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # --nproc-per-node: torch's agent reports the first rank to exit; be stopped by it once it
            # has seen that rank's exit, so the job's exit code is that rank's (2 for a user error).
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            time.sleep(PEER_GONE_WAIT_S)
        # Without the interpreter's shutdown: tearing down a process group whose peer is gone could
        # block there, and the whole job with it (1 launch in 6 hung so on a 3-node cluster).
        os._exit(1)


def say(line: str) -> None:
    """One line on stderr in one write: print() writes the text and its newline apart, so the lines of
    ranks failing at once ran together ("...load tooerror: ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


PEER_GONE_WAIT_S = 20.0  # how long a rank whose peer is gone waits to be stopped before it exits
# What gloo says when the rank at the other end of a collective has exited.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def another_rank_ended(exc: BaseException) -> bool:
    from xeontune.train.ranks import inside_a_launch

    return inside_a_launch() and isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_GONE)


def _rank() -> str:
    return os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))


def _plan_ranks(opts):
    """Decide and say how many ranks run here, and what the global batch is."""
    from xeontune.hardware import choose_precision
    from xeontune.train import ranks

    precision = choose_precision(opts.mixed_precision)[0]
    plan = ranks.plan_ranks(opts, precision)
    accumulation = f" x {opts.gradient_accumulation_steps} accumulation" if opts.gradient_accumulation_steps > 1 else ""
    global_batch = opts.train_batch_size * plan.ranks * opts.gradient_accumulation_steps
    print(f"{plan.ranks} rank(s) on this machine, {plan.cores_per_rank} core(s) each ({plan.why}); "
          f"global batch {opts.train_batch_size} x {plan.ranks} rank(s){accumulation} = {global_batch}")
    return plan, precision


if __name__ == "__main__":
    # Re-exec once with tcmalloc (or jemalloc) preloaded when this host has it; XEONTUNE_ALLOCATOR=none
    # turns this off. Only here and in the CLI: a caller importing main() keeps its own process.
    from xeontune.hardware import defer_gc, reexec_with_allocator

    reexec_with_allocator(["-m", "xeontune.train", *sys.argv[1:]])
    defer_gc()  # until the models are loaded (loop.train calls resume_gc)
    sys.exit(main())
