"""Page script for st.navigation (see app/main.py)."""
from stagewise.app.model_page import model_page

model_page()
