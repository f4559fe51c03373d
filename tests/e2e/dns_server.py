"""A real DNS server (UDP) inside the test process, answering A queries for the
names the test gives addresses: the cluster DNS of a headless Service, whose
records are its ready pods."""
from __future__ import annotations

import socket
import threading

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class DnsServer:
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self.address = "%s:%d" % self._socket.getsockname()
        threading.Thread(target=self._serve, name="dns-server", daemon=True).start()

    def set(self, name: str, ips: list[str]) -> None:
        self.records[name] = list(ips)

    def stop(self) -> None:
        self._socket.close()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self._socket.recvfrom(4096)
                self._socket.sendto(self._answer(dns.message.from_wire(data)).to_wire(), peer)
            except OSError:  # closed
                return

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        question = query.question[0]
        ips = self.records.get(question.name.to_text(omit_final_dot=True))
        if ips is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and ips:
            response.answer.append(dns.rrset.from_text_list(
                question.name, 5, dns.rdataclass.IN, dns.rdatatype.A, ips))
        return response
