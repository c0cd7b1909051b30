"""The Kubernetes backend: every node is a pod of one Indexed Job, found by a headless Service.

``backend`` wires the parts; ``render`` (objects), ``runtimes`` (the platform's runtimes),
``status`` and ``explain`` (reading objects back) are pure; ``api`` describes requests as data,
``client`` sends them (sync and async); ``lifecycle``, ``observe`` and ``logs`` are the flows that
yield them.
"""
