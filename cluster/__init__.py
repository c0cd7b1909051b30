"""``make cluster``: a real single-machine Kubernetes cluster, built from pinned upstream releases.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, two kubelets (two nodes, each with
its own containerd and runc), the CNI bridge/host-local/loopback plugins, CoreDNS and, for the
queueing tests, Kueue, all started as host processes under ``.state/cluster/`` (the pattern of
Kubernetes' own ``hack/local-up-cluster.sh``), each built with Go from the module proxy by the
modules in ``cluster/go/`` and cached per version under ``~/.cache/airflow-torchrun/cluster``.

``python -m cluster up|down|status|env|build`` (the Makefile's ``cluster``, ``cluster-down``).
"""
