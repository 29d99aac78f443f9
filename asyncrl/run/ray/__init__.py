"""A run on a Ray cluster: the cluster (``cluster``), where each role goes
(``placement``, ``plan``), the actors that host the roles (``actors``) and the
driver that supervises them (``run``). Ray is imported only inside these modules."""
