"""The cluster descriptions that ship with recc (YAML, one per file): ``recc.Cluster.from_yaml``
finds them by name from any directory (``--cluster zionex-16x8``); ``recc.Cluster.shipped()``
lists them."""
