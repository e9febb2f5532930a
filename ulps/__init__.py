"""Upper-layer protocols written once against the portable verbs + rdma_cm API."""
