"""RDS: reliable, ordered datagrams between (IP, port) endpoints.

All sockets of two nodes share one RC connection.
"""
