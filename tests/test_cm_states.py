"""rdma_cm's one table (``rdmashim.cm.states``), and every backend's CM id held to it.

The table itself: every state but DESTROYED is reached from a new id, destroy is
allowed everywhere, each refusal names the call and the state in words.
docs/cm.md shows it as :func:`render` writes it. The backends' CM id modules (those
built on ``rdmashim.cm.base``) never set a state themselves: the base moves it, by
the table. And every (state, call) pair of ``tests/api/test_cm_states.py`` runs on
every registered backend of this machine (one that is unavailable here is skipped,
saying why).
"""

from __future__ import annotations

import ast
import errno
from pathlib import Path

import pytest
import trio
from api.test_cm_states import PAIRS, check

from rdmashim.cm import CMEventType, CMState, CMStateError, EventChannel
from rdmashim.cm.states import TRANSITIONS, WORDS, Call, allowed, needs, refusal
from rdmashim.registry import BACKENDS, backend_status
from rdmashim.verbs.errors import BackendUnavailable, VerbsError

REPO = Path(__file__).resolve().parents[1]
S = CMState


def render() -> str:
    """The table as docs/cm.md shows it: a row per state, its calls and its events."""
    rows = [
        "| state | the CM id is | calls it allows (→ the state that follows) | events |",
        "| --- | --- | --- | --- |",
    ]
    for state in CMState:
        calls = [
            f"`{call.value}`" + ("" if then is state else f" → {then.name}")
            for call in Call
            if (then := TRANSITIONS.get((state, call))) is not None
        ]
        events = [
            f"{kind.name} → {then.name}"
            for kind in CMEventType
            if (then := TRANSITIONS.get((state, kind))) is not None
        ]
        cells = [state.name, WORDS[state], ", ".join(calls), ", ".join(events) or "—"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def test_docs_show_the_table() -> None:
    assert render() in (REPO / "docs/cm.md").read_text(), f"docs/cm.md should hold:\n{render()}"


def test_every_state_but_destroyed_is_reached_from_a_new_id_and_destroy_ends_every_one() -> None:
    reached, todo = {S.IDLE}, [S.IDLE]
    while todo:
        state = todo.pop()
        for (before, _), after in TRANSITIONS.items():
            if before is state and after not in reached:
                reached.add(after)
                todo.append(after)
    assert reached == set(CMState)
    assert all(TRANSITIONS[(state, Call.DESTROY)] is S.DESTROYED for state in CMState)
    assert needs(Call.CONNECT) == (S.ROUTE_RESOLVED,)


def test_a_refusal_names_the_call_the_state_and_what_the_call_needs() -> None:
    exc = refusal(S.LISTEN, Call.CONNECT)
    assert isinstance(exc, CMStateError) and isinstance(exc, VerbsError)
    assert (exc.errno, exc.operation) == (errno.EINVAL, "connect")
    assert str(exc) == (
        "[Errno 22] connect: Invalid argument (the CM id is listening (LISTEN); "
        "connect needs one that is resolved to a route (ROUTE_RESOLVED))"
    )
    listen = refusal(S.CONNECT, Call.LISTEN)
    assert "listen needs one that is new (IDLE) or bound to a local address (ADDR_BOUND)" in str(
        listen
    )
    gone = refusal(S.DESTROYED, Call.BIND_ADDR)
    assert (gone.errno, gone.detail) == (errno.EBADF, "the CM id is destroyed")
    assert not allowed(S.DESTROYED, Call.DESTROY_QP) and allowed(S.DESTROYED, Call.DESTROY)


def _cm_id_modules() -> list[Path]:
    """The backends' modules whose CM ids build on ``rdmashim.cm.base``."""
    found = []
    for path in sorted((REPO / "providers").glob("*/*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(
            isinstance(node, ast.ImportFrom) and node.module == "rdmashim.cm.base"
            for node in ast.walk(tree)
        ):
            found.append(path)
    return found


def test_every_backends_cm_id_moves_only_by_the_table() -> None:
    """No CM id module assigns a ``state``: the base moves it (``_move``, ``_report``)."""
    modules = _cm_id_modules()
    backends = {path.parent.name for path in modules}
    assert backends == {"softiwarp", "rdmacore", "ibal"}, modules
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for leaf in ast.walk(target):
                    assert not (isinstance(leaf, ast.Attribute) and leaf.attr == "state"), (
                        f"{path.relative_to(REPO)}:{node.lineno} sets a state itself"
                    )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_every_call_in_every_state_on_every_backend(backend: str) -> None:
    """Each pair on a channel of its own; every deviation is listed."""
    why = {info.name: reason for info, reason in backend_status()}[backend]
    if why is not None:
        pytest.skip(f"{backend} is unavailable here: {why}")
    deviations = []
    for pair in PAIRS:
        recipe, call = pair.values
        try:
            with trio.fail_after(30):
                async with EventChannel(backend=backend) as channel:
                    await check(channel, recipe, call)
        except BackendUnavailable as exc:
            pytest.skip(f"{backend} has no CM here: {exc}")
        except (AssertionError, OSError, ExceptionGroup, trio.TooSlowError) as exc:
            deviations.append(f"{pair.id}: {exc!r}")
    assert not deviations, f"{backend}: {len(deviations)} of {len(PAIRS)}:\n" + "\n".join(
        deviations
    )
