"""Page script for st.navigation (see app/main.py)."""
from stagewise.app.export_page import export_page

export_page()
