"""The job wing: one job, from the `--` training options to its outputs on this machine.

- ``spec``: the launch spec, read once (the options as a rank reads them, every check made before
  anything bills); it creates nothing.
- ``engines``: how ranks start (mpirun, srun, Ray, torch's elastic agent; Kubernetes' manifests).
- ``start``: one start for `launch`, `launch --detach` and `run` (the engine's plan, preflight).
- ``process``: the job's processes, attached (signals passed on) or detached on the head.
- ``record``: ``job.json``, what `fetch` and `logs` read.
- ``fetch``: `xeontune fetch` and `xeontune logs`.
- ``run``: `xeontune run` (up, start, fetch, teardown).
"""
