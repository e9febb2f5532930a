"""Connection management in librdmacm's model (event channel, CM ids, resolve, connect).

The connectors for each backend live here; see ARCHITECTURE.md, "Connection management".
"""
