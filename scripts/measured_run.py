"""Two helpers for scripts/example-figures.sh, where /usr/bin/time may be missing.

    measured_run.py run SECONDS CMD...   run CMD in its own session, killed after SECONDS; print
                                         "RESULT rc=.. wall=..s peak_rss_mb=.." (the largest process's
                                         peak RSS, what `/usr/bin/time -v` reports)
    measured_run.py summary LOG          per "== NAME (limit" block of LOG: the STEP times of
                                         scripts/step-times (the first, which holds the start, left out),
                                         their median and the RESULT line
"""

import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time


def run(limit: float, command: list[str]) -> None:
    start = time.time()
    process = subprocess.Popen(command, start_new_session=True)
    try:
        rc: object = process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the whole session: ranks and workers too
        process.wait()
        rc = "timeout"
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"RESULT rc={rc} wall={time.time() - start:.1f}s peak_rss_mb={peak_mb:.0f}", file=sys.stderr, flush=True)


def summary(log: str) -> None:
    runs: dict[str, dict] = {}
    name = None
    with open(log, errors="replace") as lines:
        for line in lines:
            if header := re.match(r"== (\S+) \(limit", line):
                name = header.group(1)
                runs[name] = {"steps": [], "result": ""}
            elif name:
                # a progress bar's carriage returns can put a STEP or RESULT mid-line
                runs[name]["steps"] += [float(s) for s in re.findall(r"STEP ([\d.]+)", line)]
                if result := re.search(r"RESULT .*", line):
                    runs[name]["result"] = result.group(0)
    for name, found in runs.items():
        steps = found["steps"][1:]
        median = f"{statistics.median(steps):.3f}" if steps else "-"
        print(f"{name}: median {median} s/step of {len(steps)} {[round(s, 2) for s in steps]} {found['result']}")


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "run":
        run(float(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        summary(sys.argv[2])
    else:
        sys.exit(__doc__)
