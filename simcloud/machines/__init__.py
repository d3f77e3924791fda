"""The machines behind the Nodes: one kubelet per node (leases, status, device plugins, pods) and the
containers it runs as local processes.
"""
