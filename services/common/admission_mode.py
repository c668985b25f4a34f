"""The admission mode (paper §4.3): one setting that admission, the conductor and the
decode workers each follow, so the three cannot disagree about where a request that
breaks the TBT SLO is refused.

    mode      admission (at the door)          conductor (placement)   decode worker
    baseline  accepts all (BaselinePolicy)     no TBT rejection        rejects after the
                                                                       prefill (DecodeSideCheck)
    early     both pools under their SLO load  TBT rejection           takes what it is given
    predict   prefill + predicted decode pool  TBT rejection           takes what it is given

Set once per deployment: ``PERIGEE_ADMISSION_MODE`` in the environment of every service
(``perigee up --admission``, compose.yaml's shared environment, deploy/k8s's
perigee-config), or ``--admission-mode`` on the command line of a service run alone; a
flag that contradicts the environment is a start-up error, not an override.
The simulator (``perigee sim --admission``) takes the same names and the same table.
"""

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise


class AdmissionMode(StrEnum):
    """Where overload is refused: at the door (early, predict) or after prefill (baseline)."""

    BASELINE = "baseline"
    EARLY = "early"
    PREDICT = "predict"


ENV = "PERIGEE_ADMISSION_MODE"
FLAG = "--admission-mode"
DEFAULT = AdmissionMode.EARLY
# The services whose behaviour depends on the mode (python -m <module>).
SERVICES = ("services.admission", "services.conductor", "services.prefill", "services.decode")


@dataclass(frozen=True)
class Behaviour:
    """What each service does in one mode."""

    admission_policy: str  # services.admission.admission_policy.ADMISSION_POLICIES name
    placement_tbt_check: bool  # the conductor rejects a placement over the TBT SLO
    decode_gate: bool  # a decode instance rejects a prefilled request over the TBT SLO


BEHAVIOUR: Mapping[AdmissionMode, Behaviour] = {
    AdmissionMode.BASELINE: Behaviour("baseline", placement_tbt_check=False, decode_gate=True),
    AdmissionMode.EARLY: Behaviour("early", placement_tbt_check=True, decode_gate=False),
    AdmissionMode.PREDICT: Behaviour("predict", placement_tbt_check=True, decode_gate=False),
}


def names() -> list[str]:
    return [m.value for m in AdmissionMode]


def parse(text: str, source: str = FLAG) -> AdmissionMode:
    """``text`` as a mode; ValueError naming ``source`` and the known modes."""
    try:
        return AdmissionMode(text.strip().lower())
    except ValueError:
        raise ValueError(
            f"{source}: unknown admission mode {text!r}; one of {', '.join(names())}"
        ) from None


def behaviour(mode: AdmissionMode | str) -> Behaviour:
    return BEHAVIOUR[parse(mode) if isinstance(mode, str) else mode]


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        FLAG,
        default=None,
        metavar="{" + ",".join(names()) + "}",
        help=f"where overload is refused (paper §4.3), the same for admission, conductors "
        f"and decode workers (default: ${ENV}, else {DEFAULT})",
    )


def settle(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    legacy: tuple[str, str | None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> AdmissionMode:
    """Set ``args.admission_mode`` to the mode this process follows: ``--admission-mode``
    or ``$PERIGEE_ADMISSION_MODE`` (the deployment's one setting), else early.
    ``legacy`` is an older flag that also names a mode (admission's ``--policy``) and its
    value. Any two of them that disagree, or a value that names no mode, is a start-up
    error (``p.error``, exit 2): one service following another mode than the rest is
    the split this setting exists to prevent."""
    env = os.environ if environ is None else environ
    given: list[tuple[str, AdmissionMode]] = []
    try:
        if args.admission_mode is not None:
            given.append((FLAG, parse(args.admission_mode)))
        if env.get(ENV, "").strip():
            given.append((f"${ENV}", parse(env[ENV], f"${ENV}")))
        if legacy is not None and legacy[1] is not None:
            given.append((legacy[0], parse(legacy[1], legacy[0])))
    except ValueError as e:
        p.error(str(e))
    for (src, mode), (other, other_mode) in pairwise(given):
        if mode != other_mode:
            p.error(
                f"{src} {mode} contradicts {other} {other_mode}: the admission mode is one "
                f"setting for admission, conductors and decode workers"
                + (f" ({legacy[0]} is replaced by {FLAG})" if legacy is not None else "")
            )
    chosen = given[0][1] if given else DEFAULT
    args.admission_mode = chosen
    return chosen
