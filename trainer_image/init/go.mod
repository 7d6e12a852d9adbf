module tpujob.dev/trainer-init

go 1.25
