"""The engine core in its own process, talking to the front over ZeroMQ.

IO threads move bytes; the step loop only sees queues, so HTTP, tokenization and
detokenization in the front never hold up a step. Messages are pickled `ipc.Message`s.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time
import traceback

import zmq

from llmserve.config import EngineConfig
from llmserve.engine.engine_core import EngineCore, StepPipeline, step_pipeline
from llmserve.engine.ipc import Kind, Message, UtilityCall, UtilityResult
from llmserve.engine.pp_batches import BatchQueue
from llmserve.engine.request import EngineCoreOutputs
from llmserve.engine.step_log import step_timing_log
from llmserve.heap import freeze_startup_objects, unfreeze

logger = logging.getLogger(__name__)
UTILITIES = frozenset(
    {"reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "memory_footprint", "add_lora", "remove_lora"}
)  # EngineCore methods the front may call

_SHUTDOWN = Message(Kind.SHUTDOWN)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the core process."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(output_addr)
    try:
        core = EngineCore(config, exit_on_worker_death=True)
    except Exception as exc:  # a bad config or model: tell the front why, then exit
        out_sock.send(pickle.dumps(Message(Kind.ERROR, f"{type(exc).__name__}: {exc}")))
        out_sock.close(linger=2000)
        ctx.term()
        raise SystemExit(1) from None
    proc = EngineCoreProc(core, ctx, input_addr, out_sock)
    freeze_startup_objects("engine core")
    try:
        proc.run()
    finally:
        unfreeze()
        core.shutdown()


class EngineCoreProc:
    def __init__(self, core: EngineCore, ctx: zmq.Context, input_addr: str, out_sock: zmq.Socket) -> None:
        self.core = core
        self.ctx = ctx
        self.input_addr = input_addr
        self.out_sock = out_sock
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.parent_pid = os.getppid()

    def run(self) -> None:
        threading.Thread(target=self._input_thread, daemon=True, name="core-input").start()
        sender = threading.Thread(target=self._output_thread, daemon=True, name="core-output")
        sender.start()
        stats = self.core.stats()
        workers = self.core.tp_driver.worker_pids if self.core.tp_driver else []
        self._send(
            Message(Kind.READY, {"num_blocks": stats.num_blocks_total, "pid": os.getpid(), "worker_pids": workers})
        )
        try:
            self._loop()
        except Exception:
            self._send(Message(Kind.ERROR, traceback.format_exc()))
            raise
        finally:
            self.outputs.put(None)
            sender.join(5)
            self.out_sock.close(linger=1000)

    def _loop(self) -> None:
        with step_timing_log(self.core.config.step_timing_log) as step_log:
            self._steps(step_pipeline(self.core, step_log))

    def _steps(self, pipeline: StepPipeline | BatchQueue) -> None:
        while True:
            handled = False
            if not self.core.has_unfinished() and not pipeline.busy:
                if not self._handle(self.inputs.get()):
                    return
                handled = True
            while not self.inputs.empty():
                if not self._handle(self.inputs.get_nowait()):
                    return
                handled = True
            if self.core.has_unfinished() or pipeline.busy:
                pipeline.launch()
                while not self.inputs.empty():  # new requests and aborts, while the device works
                    if not self._handle(self.inputs.get_nowait()):
                        return
                done = pipeline.finish()
                if done is not None:
                    self._send(Message(Kind.OUTPUTS, done))
            elif handled:  # e.g. an abort emptied the engine: report the freed blocks
                self._send(Message(Kind.OUTPUTS, EngineCoreOutputs([], self.core.stats())))

    def _handle(self, msg: Message) -> bool:
        if msg.kind is Kind.ADD:
            error = self.core.add_request(msg.payload)
            if error is not None:
                self._send(Message(Kind.OUTPUTS, EngineCoreOutputs([error], self.core.stats())))
        elif msg.kind is Kind.ABORT:
            self.core.abort_requests(msg.payload)
        elif msg.kind is Kind.UTILITY:
            self._send(Message(Kind.UTILITY_RESULT, self._utility(msg.payload)))
        elif msg.kind is Kind.SHUTDOWN:
            return False
        return True

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.name not in UTILITIES:
            return UtilityResult(call.call_id, error=f"no utility {call.name!r}")
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.name)(*call.args))
        except Exception as exc:  # noqa: BLE001 - the caller learns why; the core goes on
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _send(self, msg: Message) -> None:
        self.outputs.put(msg)

    def _output_thread(self) -> None:
        """Pickle and send here, so the step loop goes on to the next step meanwhile."""
        while (msg := self.outputs.get()) is not None:
            self.out_sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _input_thread(self) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(self.input_addr)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while True:
            if poller.poll(1000):
                msg = pickle.loads(sock.recv())
                if msg.kind is Kind.ADD:
                    msg.payload.received_time = time.time()
                self.inputs.put(msg)
                if msg.kind is Kind.SHUTDOWN:
                    break
            elif os.getppid() != self.parent_pid:  # the front died: do not linger
                self.inputs.put(_SHUTDOWN)
                break
        sock.close(linger=0)
