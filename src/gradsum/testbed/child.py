"""Run one pickled call inside a testbed host: ``python -m gradsum.testbed.child``.

stdin: a pickled ``(function, args, kwargs)``; the function must be importable by reference.
stdout: a pickled ``("ok", result)`` or ``("error", type_name, message, traceback_text)``.
While the function runs, fd 1 points to stderr, so its prints (and those of C extensions such as
Gloo) cannot corrupt the reply.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

from ..failures import describe_failure


def main() -> int:
    fn, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        reply = ("ok", fn(*args, **kwargs))
    except BaseException as error:
        reply = ("error", *describe_failure(error), traceback.format_exc())
    with os.fdopen(reply_fd, "wb") as out:
        pickle.dump(reply, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
