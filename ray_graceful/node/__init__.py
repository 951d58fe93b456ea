"""What runs once per node for a job: the node agent (``agent.py``), which relays the node's
rank processes to the coordinator (``relay.py``) and polls the cloud's metadata service
(``cloud_poller.py``). Neither ``worker/`` nor ``coordinator/`` is imported here."""
