"""What the gpipe-transformers tests share: tiny models of each family (:mod:`.models`),
ranks in processes of their own (:mod:`.ranks`) and the cases they run (:mod:`.cases`)."""
