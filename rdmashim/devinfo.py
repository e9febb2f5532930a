"""What ``rdmashim devinfo`` prints: a device's attributes in ``ibv_devinfo``'s layout.

The text follows rdma-core's ``ibv_devinfo`` field by field, so eyes and
scripts used to that tool read it the same way: the same names, the same
tab-aligned columns, GUIDs as four colon-separated groups of four hex digits,
enumerations as ``NAME (value)`` (``PORT_ACTIVE (4)``, ``4096 (5)``,
``iWARP (1)``), and ``-l``'s ``N HCAs found:`` list.

Only what the portable :class:`~rdmashim.verbs.attrs.DeviceAttr` and
:class:`~rdmashim.verbs.attrs.PortAttr` carry is shown; a field ``ibv_devinfo``
has and they do not is left out rather than made up. A few lines that are
rdmashim's own (the backend, the port's network interface, the transport's
private-data limit) follow ``ibv_devinfo``'s fields in the verbose form.

The formatting functions are pure; :func:`devinfo_lines` opens the devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import rdmashim
from rdmashim.cliargs import UsageError
from rdmashim.registry import load_backend
from rdmashim.verbs.attrs import DeviceAttr, PortAttr
from rdmashim.verbs.enums import AtomicCap, Mtu, PortState, Transport

DEVICE_COLUMN = 40
"""Where ``ibv_devinfo`` puts a device field's value (tab stops of 8)."""
PORT_COLUMN = 48
"""Where ``ibv_devinfo`` puts a port field's value."""

_E = TypeVar("_E", bound=int)
_TRANSPORTS = {Transport.IB: "InfiniBand", Transport.IWARP: "iWARP"}
_PORT_STATES = {
    PortState.DOWN: "PORT_DOWN",
    PortState.INIT: "PORT_INIT",
    PortState.ARMED: "PORT_ARMED",
    PortState.ACTIVE: "PORT_ACTIVE",
}
_ATOMIC_CAPS = {
    AtomicCap.NONE: "ATOMIC_NONE",
    AtomicCap.HCA: "ATOMIC_HCA",
    AtomicCap.GLOB: "ATOMIC_GLOB",
}
_VERBOSE_COUNTS = (
    "max_sge", "max_sge_rd", "max_cq", "max_cqe", "max_mr", "max_pd", "max_qp_rd_atom",
    "max_qp_init_rd_atom",
)  # fmt: skip
"""``ibv_devinfo -v``'s plain counts after ``device_cap_flags``, in its order, that
DeviceAttr carries."""


def guid_text(guid: int) -> str:
    """A GUID as ``ibv_devinfo`` spells it: ``6c6f:00ff:fe00:0000``."""
    return ":".join(f"{(guid >> shift) & 0xFFFF:04x}" for shift in (48, 32, 16, 0))


def enum_text(names: Mapping[_E, str], value: _E, unknown: str) -> str:
    """``NAME (value)``, with ``ibv_devinfo``'s word for a value it has no name for."""
    return f"{names.get(value, unknown)} ({int(value)})"


def mtu_text(mtu: Mtu) -> str:
    """A verbs MTU as ``4096 (5)``."""
    return f"{128 << mtu} ({int(mtu)})"


def field(indent: int, name: str, value: object, column: int) -> str:
    """One ``name:<tabs>value`` line, tabbed out to ``column`` as ``ibv_devinfo`` aligns it."""
    start = 8 * indent + len(name) + 1
    tabs = max(1, column // 8 - start // 8)
    return "\t" * indent + f"{name}:" + "\t" * tabs + str(value)


def list_lines(names: Sequence[str]) -> list[str]:
    """``ibv_devinfo -l``: the count line, one indented name per device, a blank line."""
    plural = "" if len(names) == 1 else "s"
    return [f"{len(names)} HCA{plural} found:", *(f"\t{name}" for name in names), ""]


def device_lines(
    name: str,
    backend: str,
    attr: DeviceAttr,
    ports: Sequence[tuple[int, PortAttr]],
    *,
    verbose: bool = False,
    backend_info: str = "",
) -> list[str]:
    """The ``ibv_devinfo`` text of one device and the given ``(number, attributes)`` ports
    (``backend_info``: the backend's description, shown with ``verbose``)."""

    def dev(key: str, value: object) -> str:
        return field(1, key, value, DEVICE_COLUMN)

    lines = [
        f"hca_id:\t{name}",
        dev("transport", enum_text(_TRANSPORTS, attr.transport, "invalid transport")),
    ]
    if attr.fw_ver:
        lines.append(dev("fw_ver", attr.fw_ver))
    lines += [
        dev("node_guid", guid_text(attr.node_guid)),
        dev("sys_image_guid", guid_text(attr.sys_image_guid)),
        dev("vendor_id", f"{attr.vendor_id:#06x}"),
        dev("vendor_part_id", attr.vendor_part_id),
        dev("hw_ver", f"0x{attr.hw_ver:X}"),
        dev("phys_port_cnt", attr.phys_port_cnt),
    ]
    if verbose:
        lines += [
            dev("max_mr_size", f"{attr.max_mr_size:#x}"),
            dev("page_size_cap", f"{attr.page_size_cap:#x}"),
            dev("max_qp", attr.max_qp),
            dev("max_qp_wr", attr.max_qp_wr),
            dev("device_cap_flags", f"0x{attr.device_cap_flags:08x}"),
        ]
        lines += [dev(key, getattr(attr, key)) for key in _VERBOSE_COUNTS]
        lines += [
            dev(
                "atomic_cap", enum_text(_ATOMIC_CAPS, attr.atomic_cap, "invalid atomic capability")
            ),
            dev("max_mw", attr.max_mw),
            dev("max_srq", attr.max_srq),
        ]
        if attr.max_srq:
            lines += [dev("max_srq_wr", attr.max_srq_wr), dev("max_srq_sge", attr.max_srq_sge)]
        lines += [
            dev("max_inline_data", attr.max_inline_data),
            dev("max_private_data", attr.max_private_data),
            dev("active_side_sends_first", "yes" if attr.active_side_sends_first else "no"),
            dev("backend", backend),
        ]
        if backend_info:
            lines.append(dev("backend_info", backend_info))
    for number, port in ports:
        lines += _port_lines(number, port, verbose=verbose)
    return lines


def _port_lines(number: int, port: PortAttr, *, verbose: bool) -> list[str]:
    def line(key: str, value: object) -> str:
        return field(3, key, value, PORT_COLUMN)

    lines = [
        f"\t\tport:\t{number}",
        line("state", enum_text(_PORT_STATES, port.state, "invalid state")),
        line("max_mtu", mtu_text(port.max_mtu)),
        line("active_mtu", mtu_text(port.active_mtu)),
        line("sm_lid", port.sm_lid),
        line("port_lid", port.lid),
        line("port_lmc", f"0x{port.lmc:02x}"),
        line("link_layer", port.link_layer),
    ]
    if verbose:
        lines += [
            line("max_msg_sz", f"{port.max_msg_sz:#x}"),
            line("port_cap_flags", f"0x{port.port_cap_flags:08x}"),
            line("gid_tbl_len", port.gid_tbl_len),
            line("netdev", port.netdev),
        ]
    return [*lines, ""]


async def devinfo_lines(
    name: str | None, backend: str | None, port: int | None, verbose: bool
) -> list[str]:
    """Open the device ``name`` (every device of the backend when None) and describe it.

    ``port`` limits the ports shown to that one; a port the device does not have is a
    :class:`~rdmashim.cliargs.UsageError`.
    """
    # With no device at all, opening the backend's default says why there is none.
    names: list[str | None] = (
        [name]
        if name
        else [dev.name for dev in rdmashim.get_device_list(backend=backend)] or [None]
    )
    lines: list[str] = []
    for each in names:
        async with rdmashim.open_device(each, backend=backend) as ctx:
            attr = ctx.query_device()
            if port is not None and port > attr.phys_port_cnt:
                count = attr.phys_port_cnt
                ports_text = "1 port" if count == 1 else f"{count} ports"
                raise UsageError(f"-i {port}: no such port ({ctx.device.name} has {ports_text})")
            numbers = [port] if port is not None else range(1, attr.phys_port_cnt + 1)
            ports = [(number, ctx.query_port(number)) for number in numbers]
            info = load_backend(ctx.backend).description
            lines += device_lines(
                ctx.device.name, ctx.backend, attr, ports, verbose=verbose, backend_info=info
            )
    return lines


__all__ = [
    "DEVICE_COLUMN",
    "PORT_COLUMN",
    "device_lines",
    "devinfo_lines",
    "enum_text",
    "field",
    "guid_text",
    "list_lines",
    "mtu_text",
]
