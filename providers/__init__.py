"""The backends (providers) of the portable verbs and rdma_cm API, each in a package of
its own: ``softiwarp`` (the built-in iWARP engine), ``rdmacore`` (Linux rdma-core) and
``ibal`` (the Windows-style IBAL facade over any of them). Nothing here is imported by
the portable layers; the registry (:mod:`rdmashim.verbs.backend`) loads a backend by name.
"""
