"""The IPython shell that runs user code inside a worker, with its outputs sent as messages.

IPython does the work (magics, `!cmd`, display formatting, tracebacks, matplotlib inline);
we only route what it produces: display data, the cell's result and errors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from traitlets import Any as AnyTrait
from traitlets import Type

from ..protocol import MessageType, contents

T = MessageType
Emit = Callable[[MessageType, Mapping[str, Any]], None]


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


class WorkerDisplayPublisher(DisplayPublisher):
    """`display(...)`, HTML, images and figures become display_data messages."""

    emit = AnyTrait()

    def publish(
        self,
        data: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        source: Any = None,
        *,
        transient: dict[str, Any] | None = None,
        update: bool = False,
        **kwargs: Any,
    ) -> None:
        _flush_streams()
        kind = T.UPDATE_DISPLAY_DATA if update else T.DISPLAY_DATA
        self.emit(kind, contents.DisplayData(data=data, metadata=metadata or {}, transient=transient or {}))

    def clear_output(self, wait: bool = False) -> None:
        _flush_streams()
        self.emit(T.CLEAR_OUTPUT, contents.ClearOutput(wait=wait))


class WorkerDisplayHook(DisplayHook):
    """The value of a cell's last expression becomes an execute_result message."""

    emit = AnyTrait()

    def start_displayhook(self) -> None:
        self._data: dict[str, Any] = {}
        self._metadata: dict[str, Any] = {}

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict: dict[str, Any], md_dict: dict[str, Any] | None = None) -> None:
        self._data = format_dict
        self._metadata = md_dict or {}

    def finish_displayhook(self) -> None:
        _flush_streams()
        if self._data:
            self.emit(
                T.EXECUTE_RESULT,
                contents.ExecuteResult(data=self._data, metadata=self._metadata, execution_count=self.prompt_count),
            )


class WorkerShell(InteractiveShell):
    displayhook_class = Type(WorkerDisplayHook)
    display_pub_class = Type(WorkerDisplayPublisher)
    emit = AnyTrait()
    on_user_code = AnyTrait()  # on_user_code(True) as user code starts, (False) as it stops

    async def run_code(self, code_obj: Any, result: Any = None, *, async_: bool = False) -> bool:
        """IPython runs the user's code here: only in here may an interrupt raise KeyboardInterrupt."""
        self.on_user_code(True)
        try:
            ran: bool = await super().run_code(code_obj, result, async_=async_)
            return ran
        finally:
            self.on_user_code(False)

    def init_virtualenv(self) -> None:
        """IPython puts the site-packages of `$VIRTUAL_ENV` ahead on sys.path when that is not the
        running Python's: a server started from one venv inside a shell that activated another would
        have its cells import that one's packages (another torch). A worker runs in its server's
        environment, whatever the shell around the server had activated."""

    def init_displayhook(self) -> None:
        super().init_displayhook()
        cast(WorkerDisplayHook, self.displayhook).emit = lambda kind, content: self.emit(kind, content)

    def init_display_pub(self) -> None:
        super().init_display_pub()
        cast(WorkerDisplayPublisher, self.display_pub).emit = lambda kind, content: self.emit(kind, content)

    def _showtraceback(self, etype: Any, evalue: Any, stb: list[str]) -> None:
        _flush_streams()
        self.emit(
            T.ERROR,
            contents.Error(ename=getattr(etype, "__name__", str(etype)), evalue=str(evalue), traceback=list(stb)),
        )

    def ask_exit(self) -> None:
        print("exit() is ignored in a remote cell: use %genie_shutdown in the notebook to end the session.")

    def enable_gui(self, gui: str | None = None) -> None:
        if gui not in (None, "inline"):
            raise NotImplementedError(f"GUI event loops ({gui}) cannot run in a remote worker; use inline output")
