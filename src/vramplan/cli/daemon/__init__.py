"""A warm process that answers commands without importing torch again.

Most of a traced command's time is importing torch, ``torch._dynamo`` and the model
library (5-6 s of a 6 s ResNet-50 estimate on a 2-core machine), not the trace. ``vramplan
daemon start`` starts a background process that imports them once (``server``); each
later ``estimate``, ``check``, ``max-batch``, ``plan`` or ``serve`` of the same
environment hands its arguments, working directory, environment and terminal to it
(``client``), and a child forked from the warm process runs the command on the user's own
terminal and returns its exit code. A fresh fork per command: nothing one command does is
seen by the next. A daemon serves only the environment it was started in (``key``: the
same Python, the same installed libraries and vramplan source, the same variables the
libraries read at import); any other runs the command itself, as without a daemon::

    $ vramplan daemon start          # once: about as long as one cold command
    $ vramplan estimate torchvision:resnet50 -b 32     # from here on, warm
    $ vramplan daemon stop
"""
