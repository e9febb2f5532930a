"""A batch's prepared forms: a post derives again only the entries set since, each form
catching up on its own, however long the batch (``verbs/wr.py``'s change log)."""

from __future__ import annotations

from rdmashim.verbs import SGE, RecvBatch, RecvWR, SendBatch, SendWR, WROpcode


class Form:
    """A backend's derived form that records which entries it was asked to derive."""

    def __init__(self, n: int) -> None:
        self.entries: list[object] = [None] * n
        self.derived: list[int] = []

    def set(self, i: int, wr: object) -> None:
        self.entries[i] = wr
        self.derived.append(i)


def sends(n: int) -> SendBatch:
    return SendBatch(SendWR(i, WROpcode.SEND, [SGE(0x1000 * i, 8, 7)]) for i in range(n))


def test_a_form_is_derived_once_then_only_what_changed() -> None:
    batch = sends(1000)
    form = batch.prepared("a", Form)
    assert form.derived == list(range(1000))
    form.derived.clear()
    assert batch.prepared("a", Form) is form and form.derived == []
    batch.set(7, remote_addr=99)
    batch.set(500, wr_id=5)
    batch.set(7, rkey=3)
    assert batch.prepared("a", Form) is form
    assert sorted(set(form.derived)) == [7, 500]
    assert form.entries[7].remote_addr == 99 and form.entries[7].rkey == 3  # type: ignore[attr-defined]
    form.derived.clear()
    batch.prepared("a", Form)
    assert form.derived == []


def test_two_forms_catch_up_each_on_its_own() -> None:
    batch = RecvBatch(RecvWR(i, [SGE(i, 4, 1)]) for i in range(4))
    a, b = batch.prepared("a", Form), batch.prepared("b", Form)
    a.derived.clear()
    b.derived.clear()
    batch[1] = RecvWR(41, [SGE(1, 4, 1)])
    batch.prepared("a", Form)
    batch[2] = RecvWR(42, [SGE(2, 4, 1)])
    batch.prepared("a", Form)
    batch.prepared("b", Form)
    assert a.derived == [1, 2] and b.derived == [1, 2]
    assert [w.wr_id for w in b.entries] == [0, 41, 42, 3]  # type: ignore[attr-defined]


def test_a_form_left_far_behind_derives_every_entry_again() -> None:
    batch = RecvBatch(RecvWR(i, [SGE(i, 4, 1)]) for i in range(4))
    a, b = batch.prepared("a", Form), batch.prepared("b", Form)
    for k in range(100):  # "a" keeps up, "b" is not asked for 100 changes
        batch[k % 4] = RecvWR(100 + k, [SGE(k % 4, 4, 1)])
        batch.prepared("a", Form)
    b.derived.clear()
    assert batch.prepared("b", Form) is b
    assert sorted(b.derived) == [0, 1, 2, 3]
    assert [w.wr_id for w in b.entries] == [196, 197, 198, 199]  # type: ignore[attr-defined]
    assert [w.wr_id for w in a.entries] == [196, 197, 198, 199]  # type: ignore[attr-defined]
