"""pytest front of the conformance suite (`attnx.conformance`).

    python -m pytest conformance                         # every backend available here, quick profile
    python -m pytest conformance --backend naive,blocked --profile full --device cuda
    TRITON_INTERPRET=1 python -m pytest conformance --backend triton --profile interp
"""
from __future__ import annotations

import pytest

from attnx.conformance import PROFILES


def pytest_addoption(parser):
    group = parser.getgroup("attnx conformance")
    group.addoption("--backend", action="append", default=[],
                    help="backend(s) to check: repeat or give a comma list (default: every backend available here)")
    group.addoption("--profile", choices=PROFILES, default="quick", help="case grid: quick (default), full, interp")
    group.addoption("--device", default=None,
                    help="cpu or cuda[:N] (default: cuda when the backend runs there and a GPU is present, else cpu)")
    group.addoption("--max-seqlen", type=int, default=None, help="skip cases with Sq or Sk above this")
    group.addoption("--allow-extra-declines", action="store_true",
                    help="a case declined by extra_reasons is skipped instead of failed")


def selected_backends(config) -> list[str]:
    from attnx.conformance import available_backends

    names = [n.strip() for opt in config.getoption("--backend") for n in opt.split(",") if n.strip()]
    return names or available_backends()


def pytest_generate_tests(metafunc):
    """One test per (backend, generated case); a backend that cannot run here is one skipped test."""
    if "conformance_case" not in metafunc.fixturenames:
        return
    import attnx
    from attnx.conformance import default_device, select_cases
    from attnx.conformance.runner import device_problem

    config = metafunc.config
    params = []
    for name in selected_backends(config):
        backend = attnx.get_backend(name)
        device = config.getoption("--device") or default_device(backend)
        problem = device_problem(backend, device)
        if problem:
            params.append(pytest.param((name, None, device), id=f"{name}-unavailable",
                                       marks=pytest.mark.skip(reason=problem)))
            continue
        for case in select_cases(name, config.getoption("--profile"), max_seqlen=config.getoption("--max-seqlen"),
                                 device=device):
            params.append(pytest.param((name, case, device), id=f"{name}-{case.id}"))
    metafunc.parametrize("conformance_case", params)
