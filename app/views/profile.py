"""Page script for st.navigation (see app/main.py)."""
from stagewise.app.profile_page import profile_page

profile_page()
