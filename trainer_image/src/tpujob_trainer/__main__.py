from tpujob_trainer.main import main

raise SystemExit(main())
