"""Builds the embedded Jane Austen token store in ``data/austen`` (see sympow/data/austen.py).

From the repo root (needs dpkg-deb and the ``data`` extra; no network beyond apt):

  apt-get update && apt-get download r-cran-janeaustenr
  PYTHONPATH=. python scripts/build_austen_store.py \\
      --deb r-cran-janeaustenr_1.0.0-1_all.deb --out data/austen
"""

from sympow.data.austen import main

if __name__ == "__main__":
    main()
