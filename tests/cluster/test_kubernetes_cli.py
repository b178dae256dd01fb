"""`--provider kubernetes` through the CLI: `launch` and `run` reach the kubernetes engine without a
cluster record, and its flags are refused elsewhere (the engine's own checks: test_kubernetes.py)."""

from __future__ import annotations

import yaml

from xeontune.cli import main

K8S = ["--image", "reg/xeontune:0.1", "--volume-claim", "data", "--cpus", "2", "--memory", "8Gi"]


def _train(tmp_path) -> list[str]:
    return ["--", "--model", "org/model", "--data-dir", "concept", "--placeholder-token", "<t>",
            "--initializer-token", "toy", "--validation-prompt", "a <t>", "--validation-prompt", "b <t>"]


def test_launch_and_run_dry_run_print_the_manifests_without_a_cluster(xeontune_home, capsys, tmp_path):
    for command in (["launch", "--provider", "kubernetes", "-n", "3"], ["run", "--provider", "kubernetes", "-n", "3"]):
        assert main([*command, *K8S, "--dry-run", *_train(tmp_path)]) == 0
        docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
        job = next(d for d in docs if d["kind"] == "Job")
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        # a repeatable option reaches the ranks once per value (spec.rank_args), not as a list's text
        assert [args[i + 1] for i, a in enumerate(args) if a == "--validation-prompt"] == ["a <t>", "b <t>"]
    assert not (xeontune_home / "clusters").exists()  # no record: the cluster is the user's


def test_kubernetes_flags_elsewhere_and_run_dry_run_of_a_provider_are_one_line(xeontune_home, capsys, tmp_path):
    assert main(["run", "--provider", "localhost", "--cpus", "4", *_train(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: --cpus is an option of --provider kubernetes, not of localhost"
    assert main(["launch", "--name", "c", "--image", "x", "--dry-run", *_train(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: --image is an option of --provider kubernetes, not of a cluster"
    assert main(["run", "--provider", "localhost", "--dry-run", *_train(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().startswith("error: run --dry-run prints the manifests of --provider kubernetes")
