"""The launchers of an elastic job talking to each other (`msdist.launch --nnodes MIN:MAX`).

Each launcher runs a tiny TCP service on its own address, port --master_port + 1, and polls every node it
knows twice a second (`POLL_S`). A poll is one JSON line each way: the asker's state, then the answerer's,
so both learn each other's state and address from one exchange. A state is

    {"id": "IP:PORT", "phase": waiting|running|saving|saved|draining|reforming|done|preempted|drained|failed,
     "view": {"job", "generation", "members"} or null, "nproc": N, "node_rank": the --node_rank it started with}

A node that has not answered for `MEMBER_TIMEOUT_S` is lost (its launcher killed, its host or its network
gone), except one whose last word was "done" or "preempted": its ranks ended as ours will. A node whose
last word was "failed" is gone at once; one still "waiting" `MEMBER_TIMEOUT_S` after the view that holds it
was adopted here is a new launcher on that node (the old one and its ranks are gone). Non-members that
ask are the waiting nodes, in the order they first asked. Who decides what from these facts is
msdist.launcher.membership (pure) and msdist.launcher.elastic (the restarts). MindSpore-free.
"""
import json
import socket
import socketserver
import threading
import time
from typing import Dict, List, Optional, Tuple

from msdist.base.errors import ConfigError
from msdist.launcher.membership import View

MEMBER_TIMEOUT_S = 10.0    # --membership_timeout's default: no answer this long, the node is lost (20 polls missed)
POLL_S = 0.5
_CONNECT_S = 1.0           # a host whose network is gone times out here instead of hanging the poll
ENDED = ("done", "preempted")


def own_address(contact_ip: str) -> str:
    """This host's IP as the node at `contact_ip` sees it: the source address of a route to it (no packet sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((contact_ip, 9))
            return s.getsockname()[0]
    except OSError as e:
        raise ConfigError(f"--master_addr {contact_ip} cannot be reached from this host ({e})") from None


def _exchange(address: str, state: dict) -> Optional[dict]:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_S) as s:
            s.sendall(json.dumps(state).encode() + b"\n")
            with s.makefile("rb") as reply:
                return json.loads(reply.readline())
    except (OSError, ValueError):
        return None


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True   # a launcher started again right away binds at once
    daemon_threads = True


class Peers:
    """This launcher's membership service and its view of the others.

    Args:
        me: this node's "IP:PORT".
        contact: the node asked first ("IP:PORT" of --master_addr), until this node is in a view.
        nproc: its ranks per node.
        node_rank: the --node_rank it was started with (the first formation's order).
        timeout: --membership_timeout: a member silent this long is lost, a node asking this long ago is not waiting.
    """

    def __init__(self, me: str, contact: str, nproc: int, node_rank: int, timeout: float = MEMBER_TIMEOUT_S):
        self.me, self.contact, self.timeout = me, contact, timeout
        self._state = {"id": me, "phase": "waiting", "view": None, "nproc": nproc, "node_rank": node_rank}
        self._heard: Dict[str, Tuple[float, dict]] = {}   # node -> (time.monotonic() of its last word, its state)
        self._asked: Dict[str, float] = {}                # non-members that asked -> when they first asked
        self._since = time.monotonic()                    # when this node adopted its view
        self._lock = threading.Lock()
        self._closed = threading.Event()
        peers = self

        class _Handler(socketserver.StreamRequestHandler):
            timeout = _CONNECT_S

            def handle(self):
                try:
                    asker = json.loads(self.rfile.readline())
                except ValueError:
                    return
                if not isinstance(asker, dict) or not isinstance(asker.get("id"), str):
                    return   # not one of ours (a port scan): no answer
                self.wfile.write(json.dumps(peers.answer(asker)).encode() + b"\n")

        host, port = me.rsplit(":", 1)
        try:
            self._server = _Server((host, int(port)), _Handler)
        except OSError as e:
            raise ConfigError(f"the membership port {me} (--master_port + 1) cannot be opened: {e}; choose "
                              "another --master_port") from None

    def start(self) -> "Peers":
        threading.Thread(target=self._server.serve_forever, name="msdist-peers", daemon=True).start()
        threading.Thread(target=self._poll, name="msdist-peers-poll", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------ this node's state

    @property
    def view(self) -> Optional[View]:
        view = self._state["view"]
        return View.from_dict(view) if view else None

    @property
    def phase(self) -> str:
        return self._state["phase"]

    def set(self, phase: str, view: Optional[View] = None) -> None:
        with self._lock:
            if view is not None and view.as_dict() != self._state["view"]:
                self._state = dict(self._state, view=view.as_dict())
                self._since = time.monotonic()
            self._state = dict(self._state, phase=phase)

    # ------------------------------------------------------------ what the others said

    def answer(self, state: dict) -> dict:
        """A node asked with its `state`: remember it, and answer with this node's."""
        with self._lock:
            self._heard[state["id"]] = (time.monotonic(), state)
            view = self._state["view"]
            if state.get("phase") == "waiting" and not (view and state["id"] in view["members"]):
                self._asked.setdefault(state["id"], time.monotonic())
            return self._state

    def _targets(self) -> List[str]:
        view = self.view
        known = list(view.members) if view else [self.contact]
        if view is None or self.me not in view.members:
            # Waiting: ask every node of any view heard, so the node that decides (its node 0) hears this one.
            for _, state in list(self._heard.values()):
                if state.get("view"):
                    known += state["view"]["members"]
        return [m for m in dict.fromkeys(known) if m != self.me]

    def _poll(self) -> None:
        while not self._closed.is_set():
            began = time.monotonic()
            for target in self._targets():
                answer = _exchange(target, self._state)
                if answer is not None:
                    with self._lock:
                        self._heard[target] = (time.monotonic(), answer)
            self._closed.wait(max(POLL_S - (time.monotonic() - began), 0.05))

    def state_of(self, node: str) -> Optional[dict]:
        heard = self._heard.get(node)
        return heard[1] if heard else None

    def in_phase(self, node: str, phase: str, generation: int) -> bool:
        """Whether `node` last said it is in `phase` under the view of `generation`."""
        state = self.state_of(node) or {}
        return state.get("phase") == phase and (state.get("view") or {}).get("generation") == generation

    def gone(self, view: View) -> Dict[str, str]:
        """Members of `view` that are lost or failed -> why."""
        now, gone = time.monotonic(), {}
        for m in view.members:
            if m == self.me:
                continue
            at, state = self._heard.get(m, (self._since, {}))
            silent = now - max(at, self._since)
            if state.get("phase") == "failed":
                gone[m] = "its launcher failed"
            elif state.get("phase") == "waiting" and now - self._since > self.timeout:
                # Still asking to join long after the view that holds it was decided: a new launcher there.
                gone[m] = "its launcher restarted"
            elif silent > self.timeout and state.get("phase") not in ENDED:
                gone[m] = f"lost: no answer for {silent:.0f} s"
        return gone

    def waiting(self) -> List[str]:
        """Non-members asking to join now (heard within the timeout), in the order they first asked."""
        now, view = time.monotonic(), self.view
        members = view.members if view else ()
        alive = [m for m, (at, state) in list(self._heard.items())
                 if state.get("phase") == "waiting" and now - at <= self.timeout and m not in members]
        return sorted(alive, key=lambda m: self._asked.get(m, now))

    def newest_view(self, job: Optional[str]) -> Optional[View]:
        """The newest view any node told of (of job `job`, when given)."""
        views = [View.from_dict(s["view"]) for _, s in list(self._heard.values()) if s.get("view")]
        views = [v for v in views if job is None or v.job == job]
        return max(views, key=lambda v: v.generation, default=None)
