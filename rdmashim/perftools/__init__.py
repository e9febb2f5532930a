"""perftest's tools (``ib_write_bw`` ... ``ib_send_lat``) on the portable API.

Modules: :mod:`.options` (flags), :mod:`.wire` (perftest's exchange, pure
codecs), :mod:`.report` (the banner and result table, pure), :mod:`.session`
(the rdma_cm connections and the exchange over them), :mod:`.measure` (the
measurement loops), :mod:`.run` (one run end to end), :mod:`.plot`
(``--plot``) and :mod:`.cli` (``rdmashim perf``). See ``docs/perf.md``.
"""
