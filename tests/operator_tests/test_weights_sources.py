"""Weights from a claim or a model image, on the operator's side: which weights new pods
load, when a weights edit is a refit in place and when the pods roll, and what a rolled-back
rollout keeps (plan.serving_weights, refit.rolling / needs_refit, rollout.effective_spec)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from tandem_engine.weights import WeightsRef
from tandem_operator import manifests as m
from tandem_operator.plan import Observed, plan, serving_weights
from tandem_operator.refit import FleetClients, needs_refit, refit_pass, rolling
from tandem_operator.rollout import effective_spec
from test_operator_plan import creates, make_spec, pod, steady

PVC_V1 = WeightsRef("pvc://models/llama/v1", "v1")
PVC_V2 = WeightsRef("pvc://models/llama/v2", "v2")
OCI_V1 = WeightsRef("oci://r.example.com/models/llama:v1", "v1")
OCI_V2 = WeightsRef("oci://r.example.com/models/llama:v2", "v2")


def spec_on(weights: WeightsRef, generation: int = 1):  # type: ignore[no-untyped-def]
    return make_spec(generation, model={"name": "llama", "weights": weights.to_dict()})


def test_a_new_path_on_the_same_claim_is_a_refit_in_place() -> None:
    running = steady(spec_on(PVC_V1))
    edited = spec_on(PVC_V2, 2)
    assert needs_refit(edited, running) and rolling(edited, running) == []
    assert plan(edited, running) == []  # nothing rolls: the refit moves the weights
    assert serving_weights(edited, running) == PVC_V1  # new pods start on what serves


def test_another_model_image_rolls_the_pods_which_load_the_new_weights() -> None:
    running = steady(spec_on(OCI_V1))
    edited = spec_on(OCI_V2, 2)
    assert not needs_refit(edited, running)
    assert sorted(p.name for p in rolling(edited, running)) == sorted(
        p.name for p in running.engine_pods())
    assert serving_weights(edited, running) == OCI_V2
    made = creates(plan(edited, running))
    assert made  # the rollout surges new pods on the new template ...
    for c in made:  # ... which mount the new image and load its weights
        spec = c.body["spec"]
        assert spec["initContainers"][0]["image"] == "r.example.com/models/llama:v2"
        assert c.body["metadata"]["annotations"][m.WEIGHTS_VERSION] == "v2"


def test_from_a_claim_to_a_model_image_rolls_too() -> None:
    running = steady(spec_on(PVC_V1))
    assert rolling(spec_on(OCI_V1, 2), running)
    assert not rolling(spec_on(PVC_V1, 2), Observed(pods=(pod(spec_on(PVC_V1), "decode"),)))


def test_a_rolled_back_image_rollout_returns_to_the_old_image() -> None:
    good = {"model": {"name": "llama", "weights": OCI_V1.to_dict()}, "decode": {"replicas": 2}}
    failed = {"model": {"name": "llama", "weights": OCI_V2.to_dict()}, "decode": {"replicas": 3}}
    back = effective_spec(good, failed)
    assert back["model"]["weights"] == OCI_V1.to_dict()  # the image was the failed template
    assert back["decode"]["replicas"] == 3  # the scalers' replicas stay
    same_claim = effective_spec({**good, "model": {"weights": PVC_V1.to_dict()}},
                                {**failed, "model": {"weights": PVC_V2.to_dict()}})
    assert same_claim["model"]["weights"] == PVC_V2.to_dict()  # a refit's, not the rollout's


def test_refitting_says_the_pods_roll_and_stops_saying_so_once_the_rollout_failed() -> None:
    running = steady(spec_on(OCI_V1))
    edited = spec_on(OCI_V2, 2)

    def refitting(observed: Observed) -> tuple[bool, str, str]:
        # rolling: the pass takes no engine step, so it needs no client
        done = asyncio.run(refit_pass(None, FleetClients(), edited, observed))  # type: ignore[arg-type]
        assert done.tx is None and done.report is not None
        return done.report.refitting

    status, reason, message = refitting(running)
    assert (status, reason) == (True, "RollingPods") and "oci:r.example.com" in message
    failed = replace(running, previous={"rollout": {"progressDeadlineExceeded": True}})
    status, reason, message = refitting(failed)
    assert (status, reason) == (False, "RollingPodsStopped")
    assert "Progressing condition" in message
