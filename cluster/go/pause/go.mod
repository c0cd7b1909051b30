// The pod sandbox's pause process. No registry can be reached here, so the cluster makes its own
// sandbox image from this static binary instead of pulling registry.k8s.io/pause.
module airflow-torchrun.local/cluster/pause

go 1.26.0
