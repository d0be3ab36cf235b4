"""Trust between Trainyard's processes: identities in certificates, mTLS, and who may call what."""
