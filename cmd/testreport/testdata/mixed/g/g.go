package g

func G() {}
