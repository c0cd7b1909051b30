"""The local backend (the embedded default): every node is a torchrun agent process on this machine.

``backend`` runs the group, ``supervisor`` watches one node (its own process, one per node),
``agent`` is the node's torchrun agent (torchrun's own ``main``, without the interpreter's teardown),
``procs`` finds and stops a group's processes by the marker they inherit, ``zygote`` forks the
supervisors (and they their agents) from a process that imported torch once.
"""
