"""Wake-on-LAN: the magic packet (pure) and sending it (UDP)."""

from __future__ import annotations

import re
import socket

_HEX = re.compile(r"[^0-9A-Fa-f]")


def magic_packet(mac: str) -> bytes:
    """Six 0xFF bytes, then the 6-byte MAC sixteen times (102 bytes)."""
    digits = _HEX.sub("", mac)
    if len(digits) != 12:
        raise ValueError(f"not a MAC address: {mac!r}")
    return b"\xff" * 6 + bytes.fromhex(digits) * 16


def send_magic_packet(mac: str, broadcast: str, port: int) -> None:
    """Send the packet for ``mac`` to ``broadcast:port`` (UDP, broadcast allowed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.sendto(magic_packet(mac), (broadcast, port))
