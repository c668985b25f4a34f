"""perigee up's flags (perigee.up_flags): each one whose destination is a StackConfig
field sets that field, with the field's default when not given; the rest are settled
by perigee.up.parse."""

from perigee import up_flags
from perigee.stack import StackConfig
from perigee.up import parse

BASE = ["--engine", "mock", "--store-capacity-blocks", "4096"]


def _copied_flags():
    for names, kw in (f for flags in up_flags.GROUPS.values() for f in flags):
        dest = kw.get("dest", names[0].removeprefix("--").replace("-", "_"))
        if dest in up_flags.FIELDS and dest not in ("model_dir", "store_capacity_blocks"):
            yield names[0], dest, kw


def test_every_copied_flag_sets_its_field():
    seen = []
    for name, dest, kw in _copied_flags():
        if kw.get("action") in ("store_true", "store_false"):
            cfg = parse([*BASE, name])
            assert getattr(cfg, dest) is (kw["action"] == "store_true"), name
        elif "choices" in kw:
            value = kw["choices"][0] if name != "--engine" else "mock"
            assert str(getattr(parse([*BASE, name, value]), dest)) == value, name
        else:
            kind = kw.get("type", str)
            value = kind("0.5" if name == "--trace-sample" else "3")  # a share: (0, 1]
            if name == "--block-size":  # the store must hold a whole request
                value = 64
            assert getattr(parse([*BASE, name, str(value)]), dest) == value, name
        seen.append(dest)
    assert {"nats_url", "prefill", "decode", "conductors", "speedup", "api_key"} <= set(seen)


def test_a_flag_not_given_keeps_its_fields_default():
    cfg = parse(BASE)
    d = StackConfig()
    for _, dest, kw in _copied_flags():
        if "default" not in kw and dest != "admission_mode":
            assert getattr(cfg, dest) == getattr(d, dest), dest


def test_what_parse_settles():
    cfg = parse([*BASE, "--pd-controller", "--ttft-slo", "4", "--max-restarts", "2"])
    assert cfg.switchable and cfg.supervise  # --pd-controller implies --switchable
    assert cfg.ttft_slo == 4.0 and cfg.tbt_slo == StackConfig.tbt_slo  # the mock engine's
    assert cfg.restart_policy.max_restarts == 2
    assert cfg.served_model_name == "tiny-llama" and cfg.service_args == {}


def test_trace_sample_is_a_share():
    import pytest

    assert parse([*BASE, "--trace-sample", "0.1"]).trace_sample == 0.1
    assert parse(BASE).trace_sample == 1.0
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            parse([*BASE, "--trace-sample", bad])
