"""Pure domain of the scheduler: models, the job state machine, validation. No grpc, etcd or clock."""
