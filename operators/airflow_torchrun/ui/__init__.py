"""The training view in the Airflow UI: its JSON API (:mod:`.api`, a FastAPI app the plugin serves
under ``/torchrun``), the document it returns (:mod:`.document`, pure) and the page (``view.html``)."""
