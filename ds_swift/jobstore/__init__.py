"""The job store: key-value store clients (TCPStore, etcd), membership and generations, the
job secret and signed keys, the store's URL, and what the launcher tells each worker."""
